from controller.cli import main

raise SystemExit(main())
