from benchmarks.bench.cli import main

main()
