from tandem.services.cli import main

main()
