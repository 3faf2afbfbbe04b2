from tandem.benchmarks.bench.cli import main

main()
