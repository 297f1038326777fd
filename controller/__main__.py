from homagg.controller.cli import main

raise SystemExit(main())
