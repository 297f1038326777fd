from homagg.launcher.cli import main

raise SystemExit(main())
