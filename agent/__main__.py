from agent.entry import main

raise SystemExit(main())
