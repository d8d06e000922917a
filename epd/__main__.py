from epd.cli import main

raise SystemExit(main())
