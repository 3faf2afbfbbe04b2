from tandem.services.gateway.main import main

main()
