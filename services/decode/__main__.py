from tandem.services.decode.server import main

main()
