from omnibal.cli import main

raise SystemExit(main())
