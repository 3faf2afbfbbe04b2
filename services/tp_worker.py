"""The process of a tensor-parallel rank > 0 of a service (prefill or decode): shared/parallel/worker.py's loop plus
its part of the KV transfer between tiers (services/kv_shards.py RankKVTransfer: gRPC and the wire format, which
shared/ does not import). services/engine_main.py has its engines start ranks with this module.

    python -P -m tandem.services.tp_worker --rank R --size N --store-port P --pipe-fd FD --threads T
        --kernel-threads K --device cpu|cuda
"""
import sys

from tandem.shared.parallel import worker


def main(argv: list[str] | None = None) -> int:
    from tandem.services.kv_shards import RankKVTransfer

    return worker.main(argv, kv_transfer=RankKVTransfer)


if __name__ == "__main__":
    sys.exit(main())
