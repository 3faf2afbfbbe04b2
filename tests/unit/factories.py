from tandem.shared.config import SchedulerConfig
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.request import Request, SamplingParams
from tandem.shared.scheduler import Scheduler


def make_request(request_id="r0", num_prompt_tokens=10, max_tokens=8, **params) -> Request:
    return Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens, **params))


def make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs), KVCacheManager(num_blocks, block_size))
