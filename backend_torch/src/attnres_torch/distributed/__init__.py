"""AttnRes on torch.distributed (docs/distributed.md).

- `depth_attention_tp`: hidden-dimension (tensor-parallel) sharding of depth attention; the
  all-reduces carry a few scalars per token and source.
- `sequence_sharded_prefill`: block AttnRes prefill with the block representations sharded along
  the sequence (paper section 4.2); the phase-2 merge rides on the TP reduce-scatter/all-gather.
- `PipelinePlan` / `run_pipeline`: pipeline parallelism over point-to-point ops with the paper's
  cross-stage caching (section 4.1, Eqs. 7-8), interleaved virtual stages, under the schedules
  `SCHEDULES` ("gpipe", "1f1b", "interleaved_1f1b").
- `split_stack` / `split_transformer` / `pipeline_stages`: an AttnRes stack cut into stock
  `torch.distributed.pipelining` stages (GPipe, 1F1B, interleaved 1F1B), the blocks and the
  open partial sum (Full: every output) carried as extra stage outputs; `split_hf`: the same
  for a Hugging Face model converted by `attnres_torch.hf.convert` (Llama family).
- `run_local`: a local gloo world of CPU processes (tests); `CommCounter`: elements on the wire.
"""

from .comm import CommCounter
from .hf_stages import HFChunk, split_hf
from .launch import run_local
from .pipeline import run_pipeline
from .pipeline_plan import CACHE_POLICIES, PipelinePlan, eq7_naive, eq8_cached
from .pipeline_schedule import SCHEDULES
from .sequence_parallel import (
                                all_reduce_grads,
                                gather_sequence,
                                scatter_sequence,
                                sequence_sharded_prefill,
                                shard_sequence,
)
from .stages import StackChunk, pipeline_stages, split_stack, split_transformer
from .tensor_parallel import HiddenShard, depth_attention_tp

__all__ = [
    "CACHE_POLICIES", "PipelinePlan", "SCHEDULES", "eq7_naive", "eq8_cached", "run_pipeline",
    "CommCounter", "HiddenShard", "all_reduce_grads", "depth_attention_tp", "gather_sequence",
    "run_local", "scatter_sequence", "sequence_sharded_prefill", "shard_sequence",
    "HFChunk", "StackChunk", "pipeline_stages", "split_hf", "split_stack", "split_transformer",
]
