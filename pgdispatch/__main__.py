from pgdispatch.cli import main

main()
