"""``python -m homagg.targets.soft``: homagg-softswitch (the launcher starts it this way)."""

from homagg.targets.soft.cli import main

raise SystemExit(main())
