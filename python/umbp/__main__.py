from umbp._cli import main

main()
