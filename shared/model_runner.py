"""ModelRunner: turns a SchedulerOutput into model inputs, runs one forward, samples. With LoRA it owns the
LoRAManager (shared/lora/manager.py) whose wrappers it put around the model's linears, and builds each forward's
LoRAMetadata from the batch's adapter slots."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from tandem.kernels.kv_quant import check_head_dim
from tandem.shared.attention import AttentionMetadata
from tandem.shared.config import CacheConfig, LoRAConfig, ModelConfig
from tandem.shared.lora.layers import LoRAMetadata
from tandem.shared.lora.manager import LoRAManager
from tandem.shared.model import load_model
from tandem.shared.parallel.group import TensorParallelGroup
from tandem.shared.parallel.layers import num_kv_heads_per_rank, shard_model
from tandem.shared.parallel.messages import StepInput
from tandem.shared.request import TokenLogprobs
from tandem.shared.sampler import process_logits, sample, token_logprobs
from tandem.shared.scheduler import SchedulerOutput
from tandem.shared.spec_decode.rejection_sampler import accept_draft_tokens, rejection_sample
from tandem.shared.structured_output import apply_bitmask

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one forward produced.

    sampled_token_ids: request id -> the tokens sampled for it this step, for each request whose last scheduled
        token was computed: one token, or with draft tokens scheduled, the accepted drafts and one more.
    non_finite_request_ids: requests whose logits held NaN or inf; they get no token and are failed alone.
    logprobs: request id -> one TokenLogprobs per sampled token, for requests that asked for logprobs.
    prompt_logprobs: request id -> the TokenLogprobs of the prompt tokens whose logits this step computed (those
        after request.prompt_logprobs' last), for requests that asked for prompt logprobs.
    pooled: request id -> its pooled hidden state [hidden_size] fp32 (PoolingParams: the final hidden state at its
        last token, L2-normalized unless it asked otherwise), for pooling requests whose last token this step
        computed.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    non_finite_request_ids: set[str] = field(default_factory=set)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Owns the model weights and the KV pool of one process.

    kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, row] in cache_config.dtype: row = head_dim for
    float KV; for a quantized one (cache_config.kv_quant) uint8 rows of head_dim codes + the fp32 scale
    (kernels/kv_quant.py). One tensor either way: block copies and KV transfer move its raw bytes.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str = "cpu", model=None,
                 lora_config: LoRAConfig | None = None, tp: TensorParallelGroup | None = None):
        """lora_config: serve LoRA adapters (the model's linears are wrapped; None: the model as it is). tp: this
        rank of a tensor-parallel instance (shared/parallel/): the model is sharded, the pool holds this rank's KV
        heads, and on rank 0 each forward's StepInput goes to the other ranks first (None: one process)."""
        self.model_config = model_config
        self.device = torch.device(device)
        self.tp = tp
        self.model = model if model is not None else load_model(model_config, self.device)
        num_kv_heads = model_config.num_key_value_heads
        if tp is not None:
            shard_model(self.model, model_config, tp)
            num_kv_heads = num_kv_heads_per_rank(model_config, tp.size)
        self.lora_manager = None  # (before the pool is sized: the adapters' slots take memory too)
        if lora_config is not None:
            self.lora_manager = LoRAManager(lora_config, model_config, self.model, self.device)
        if cache_config.num_blocks is None and (tp is None or tp.rank == 0):
            cache_config = replace(cache_config, num_blocks=self.num_blocks_for_memory(cache_config),
                                   memory_utilization=None)
        if tp is not None:  # (rank 0's pool size, on every rank)
            cache_config = tp.broadcast(cache_config)
        self.cache_config = cache_config  # num_blocks resolved
        if cache_config.kv_quant is not None:
            check_head_dim(model_config.head_dim, cache_config.kv_quant)
        self.kv_caches = torch.zeros(
            model_config.num_hidden_layers, 2, cache_config.num_blocks, cache_config.block_size,
            num_kv_heads, cache_config.row_size(model_config),
            dtype=cache_config.dtype, device=self.device,
        )  # fmt: skip

    def num_blocks_for_memory(self, cache_config: CacheConfig) -> int:
        """KV blocks that fit in cache_config.memory_utilization of the device memory free now (after the weights):
        torch.cuda.mem_get_info on CUDA, the OS's available RAM on CPU. ValueError if not even one block fits."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        block_bytes = cache_config.block_bytes(self.model_config)
        num_blocks = int(free * cache_config.memory_utilization) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"memory_utilization {cache_config.memory_utilization} of {free} free bytes holds no "
                             f"KV block ({block_bytes} bytes)")
        log.info("KV pool: %d blocks (%.2f GB), %.0f%% of %.2f GB free after the weights", num_blocks,
                 num_blocks * block_bytes / 1e9, 100 * cache_config.memory_utilization, free / 1e9)
        return num_blocks

    def activate_loras(self, out: SchedulerOutput) -> dict[str, str]:
        """Put the adapters of the scheduled requests into slots (out.lora_slots, by adapter key) before the
        step's forwards (the early-exit draft's included). Returns {adapter key: error} for adapters that could
        not be read again from disk (their requests must fail; they run as the base model meanwhile)."""
        if self.lora_manager is None:
            return {}
        keys = [r.lora_key for r in out.scheduled_requests if r.lora_key is not None]
        out.lora_slots, failed = self.lora_manager.activate(keys) if keys else ({}, {})
        return failed

    def execute_model(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelRunnerOutput:
        """Compute the scheduled tokens (writing their KV into the pool) and sample the next token of each
        request whose last token was computed; a request with draft tokens scheduled gets the target's token at
        each of their positions too, and keeps the drafts that pass the acceptance rule
        (spec_decode.rejection_sampler: with out.spec_draft_probs, the rule with the draft's probabilities).
        A request with prompt logprobs also gets the logits of each prompt position it computes (position p
        scores prompt token p + 1). A pooling request samples nothing: the step that computes its last token
        returns its pooled hidden state (ModelRunnerOutput.pooled). out.block_copies run first. Nothing
        scheduled: nothing runs."""
        if not out.scheduled_requests:
            return ModelRunnerOutput()
        seqs, sampled_requests, row_requests, row_positions, rope_long, lora_slots = [], [], [], [], [], []
        prompt_rows, sample_rows = [], []  # (request, first row, first position, count); the sampling rows
        pooled_requests, pooled_seqs = [], []  # pooling requests whose last token is computed; their seqs' indices
        num_rows = 0
        for request in out.scheduled_requests:
            n = out.num_scheduled_tokens[request.request_id]
            drafts = out.scheduled_spec_decode_tokens.get(request.request_id, ())
            start = request.num_computed_tokens
            token_ids = request.token_ids(start, start + n - len(drafts)) + list(drafts)
            num_logits = num_prompt = 0
            if request.sampling_params.prompt_logprobs is not None:  # positions from the first not scored yet
                first = max(start, len(request.prompt_logprobs))
                num_prompt = max(0, min(start + n, request.num_prompt_tokens - 1) - first)
                num_logits = start + n - first if num_prompt else 0
            if num_prompt:
                prompt_rows.append((request, num_rows, first, num_prompt))
            if request.pooling_params is not None:
                if out.samples(request):
                    pooled_requests.append(request)
                    pooled_seqs.append(len(seqs))
            elif out.samples(request):  # one row per draft, and one after them (the last rows of the sequence)
                num_sampled = len(drafts) + 1
                num_logits = max(num_logits, num_sampled)
                sampled_requests.append(request)
                row_requests += [request] * num_sampled
                row_positions.extend(range(request.num_tokens, request.num_tokens + num_sampled))
                sample_rows.extend(range(num_rows + num_logits - num_sampled, num_rows + num_logits))
            num_rows += num_logits
            seqs.append((token_ids, start, block_tables[request.request_id], num_logits))
            rope_long.append(bool(request.rope_long))
            lora_slots.append(out.lora_slots.get(request.lora_key))
        if self.tp is not None:
            logits = self.run_step(self.tp.broadcast(StepInput(list(out.block_copies), seqs,
                                                               rope_long if any(rope_long) else None,
                                                               pooled_seqs or None)))
        else:
            self.copy_blocks(out.block_copies)
            logits = run_model(self.model, self.kv_caches, seqs, self.cache_config.block_size, self.device,
                               rope_long=rope_long, pooled=pooled_seqs or None, kv_quant=self.cache_config.kv_quant,
                               lora_slots=lora_slots if out.lora_slots else None)
        result = ModelRunnerOutput()
        if pooled_requests:
            logits, hidden = logits  # [num_pooled, hidden_size]
            for request, h in zip(pooled_requests, hidden.cpu()):
                result.pooled[request.request_id] = F.normalize(h, dim=-1) if request.pooling_params.normalize else h
        if prompt_rows:
            for request, row, position, count in prompt_rows:
                targets = request.prompt_token_ids[position + 1 : position + 1 + count]
                result.prompt_logprobs[request.request_id] = token_logprobs(
                    logits[row : row + count], targets, request.sampling_params.prompt_logprobs)
            logits = logits[sample_rows]
        if sampled_requests:
            self._sample(out, logits, sampled_requests, row_requests, row_positions, result)
        return result

    def copy_blocks(self, block_copies) -> None:
        """(src, dst) block pairs copied in the pool, every layer, before a forward."""
        # (in order: a block copied into for a request preempted later in the same schedule may be copied into
        # again for the request that took it; the last copy is the one its owner reads)
        for src, dst in block_copies:
            self.kv_caches[:, :, dst] = self.kv_caches[:, :, src]

    def run_step(self, step: StepInput):
        """A tensor-parallel forward, the same on every rank (rank 0 sent step to the others): block copies, then
        run_model on this rank's shards and pool. Returns run_model's result (the logits gathered whole)."""
        self.copy_blocks(step.block_copies)
        return run_model(self.model, self.kv_caches, step.seqs, self.cache_config.block_size, self.device,
                         rope_long=step.rope_long, pooled=step.pooled, kv_quant=self.cache_config.kv_quant)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, sampled_requests: list, row_requests: list,
                row_positions: list[int], result: ModelRunnerOutput) -> None:
        """execute_model's last step: the sampling rows' logits [rows, vocab] fp32 (row_requests[i] and
        row_positions[i] name row i) -> each sampled request's accepted tokens (and logprobs) in result; a request
        whose logits are not all finite goes to result.non_finite_request_ids instead."""
        # NOTE: a row's sum is finite iff every logit is (|logit| is far below fp32's range / vocab): one reduction
        # instead of an elementwise test over [num_sampled, vocab].
        finite = logits.sum(-1).isfinite()
        if not bool(finite.all()):
            logits = torch.nan_to_num(logits)
        finite = finite.tolist()
        processed = process_logits(logits, row_requests, row_positions)
        if out.grammar_bitmask:
            processed = apply_grammar_bitmask(processed, logits, sampled_requests, out)
        token_ids = sample(processed, row_requests, row_positions, skip=out.spec_draft_probs.keys())
        row = 0
        for request in sampled_requests:
            request_id = request.request_id
            drafts = out.scheduled_spec_decode_tokens.get(request_id, [])
            rows = slice(row, row + len(drafts) + 1)
            row = rows.stop
            if not all(finite[rows]):
                result.non_finite_request_ids.add(request_id)
                continue
            if request_id in out.spec_draft_probs:
                sampled = rejection_sample(request, processed[rows], drafts, out.spec_draft_probs[request_id])
            else:
                sampled = accept_draft_tokens(drafts, token_ids[rows])
            result.sampled_token_ids[request_id] = sampled
            if request.sampling_params.logprobs is not None:  # (emitted token i is row rows.start + i)
                result.logprobs[request_id] = token_logprobs(logits[rows], sampled, request.sampling_params.logprobs)


def apply_grammar_bitmask(processed: torch.Tensor, logits: torch.Tensor, sampled_requests: list,
                          out: SchedulerOutput) -> torch.Tensor:
    """processed [num_rows, vocab] fp32 (rows in sampled_requests' order, num_drafts + 1 each) with each
    constrained request's rows masked by its out.grammar_bitmask; a copy when processed is the raw logits."""
    if processed is logits:
        processed = logits.clone()
    row = 0
    for request in sampled_requests:
        rows = slice(row, row + len(out.scheduled_spec_decode_tokens.get(request.request_id, ())) + 1)
        row = rows.stop
        if request.request_id in out.grammar_bitmask:
            apply_bitmask(processed[rows], out.grammar_bitmask[request.request_id], logits[rows])
    return processed


def run_model(model, kv_caches: torch.Tensor, seqs: list[tuple[list[int], int, list[int | None], int]],
              block_size: int, device: torch.device, num_layers: int | None = None,
              rope_long: list[bool] | None = None, pooled: list[int] | None = None, kv_quant: str | None = None,
              lora_slots: list[int | None] | None = None):
    """One forward of model over a batch of sequences, writing their KV into kv_caches (the pool, paged by
    block_size). seqs: per sequence (token_ids, start, block_table, num_logits): the tokens computed from
    position start, whose slots come from block_table, and how many of the last ones want logits. num_layers:
    only the model's first layers (an early-exit draft). rope_long: longrope, per sequence, whether its tokens take
    the long factors (Request.rope_long; None: none). kv_quant: the pool's quantized format (CacheConfig.kv_quant;
    None: float KV). lora_slots: per sequence, its LoRA adapter's slot (None: the base model; the list None: no
    adapters). Returns logits [sum of num_logits, vocab] fp32, in order;
    with pooled (indices into seqs), (logits, the final hidden states of those sequences' last tokens
    [len(pooled), hidden_size] fp32)."""
    input_ids, positions, slots, query_start_loc, context_lens, tables, logits_indices = [], [], [], [0], [], [], []
    for token_ids, start, block_table, num_logits in seqs:
        n = len(token_ids)
        input_ids.extend(token_ids)
        positions.extend(range(start, start + n))
        slots.extend(block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        query_start_loc.append(query_start_loc[-1] + n)
        context_lens.append(start + n)
        tables.append(block_table if not block_table or block_table[0] is not None else
                      [0 if b is None else b for b in block_table])  # (freed entries: never read, as padding)
        logits_indices.extend(range(query_start_loc[-1] - num_logits, query_start_loc[-1]))
    hidden_indices = None if pooled is None else torch.tensor([query_start_loc[i + 1] - 1 for i in pooled],
                                                              dtype=torch.int64, device=device)
    width = max(len(t) for t in tables)
    if rope_long is not None and any(rope_long):  # -> per token
        rope_long = torch.tensor([long for (ids, *_), long in zip(seqs, rope_long) for _ in ids], device=device)
    else:
        rope_long = None
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_start_loc_t=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
        rope_long=rope_long,
        kv_quant=kv_quant,
    )
    return model(
        torch.tensor(input_ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        kv_caches,
        meta,
        torch.tensor(logits_indices, dtype=torch.int64, device=device),
        num_layers,
        hidden_indices,
        LoRAMetadata.build(query_start_loc, lora_slots) if lora_slots is not None else None,
    )
