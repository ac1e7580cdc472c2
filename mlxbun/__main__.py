from mlxbun.cli import main

raise SystemExit(main())
