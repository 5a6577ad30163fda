from depthcurse.cli import main

main()
