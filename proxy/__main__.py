from proxy.cli import main

raise SystemExit(main())
