from tandem.services.prefill.server import main

main()
