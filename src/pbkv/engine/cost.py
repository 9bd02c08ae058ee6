"""What each operation costs in seconds, from first principles and a `Profile`.

- prefill: FLOPs = 2 x params x new tokens + attention 4 x layers x (heads x head_dim) x new x
  (cached + new/2) (QK^T and AV over a causal context), at `prefill_mfu` of the instance's peak;
- decode step: bound by the larger of compute (2 x params x batch) and memory traffic (all
  weights + the KV of every running context, at `decode_bw_eff` of HBM bandwidth); with
  `decode_request_ms` set (a profile `pbkv calibrate` wrote for the HF engine, which runs one
  forward per running request), batch x that fixed per-request cost + the running contexts' KV
  at that bandwidth instead (it grows with the batch as the real engine's step does);
- host->device load: KV bytes over PCIe (all GPUs' links in parallel, `pcie_eff` achieved);
  disk->device adds the disk read; each load pays a fixed latency;
- every forward pass pays `step_overhead_ms` (scheduling, kernel launches, tensor-parallel sync).
"""

from __future__ import annotations

from pbkv.cache import Tier
from pbkv.engine.profiles import Profile


class CostModel:
    def __init__(self, profile: Profile):
        p, m, g = profile, profile.model, profile.gpu
        self.profile = profile
        self.kv_bytes = p.kv_bytes_per_token
        self._flops_prefill = g.count * g.tflops * 1e12 * p.prefill_mfu
        self._flops_decode = g.count * g.tflops * 1e12 * p.decode_mfu
        self._hbm = g.count * g.hbm_gbps * 1e9 * p.decode_bw_eff
        self._pcie = g.count * g.pcie_gbps * 1e9 * p.pcie_eff
        self._disk = p.disk_gbps * 1e9
        self._params2 = 2 * m.params_b * 1e9
        self._attn = 4 * m.layers * m.heads * m.head_dim
        self._overhead = p.step_overhead_ms / 1e3
        self._per_request = None if p.decode_request_ms is None else p.decode_request_ms / 1e3

    def prefill_flops(self, new: int, cached: int) -> float:
        return self._params2 * new + self._attn * new * (cached + new / 2)

    def prefill_seconds(self, flops: float) -> float:
        """One prefill pass computing `flops` (sum of `prefill_flops` over its requests)."""
        return flops / self._flops_prefill + self._overhead

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` running requests holding `context_tokens` tokens in all."""
        if self._per_request is not None:  # one forward per request, one after another
            return batch * self._per_request + self.kv_bytes * context_tokens / self._hbm
        compute = self._params2 * batch / self._flops_decode
        memory = (self.profile.weight_bytes + self.kv_bytes * context_tokens) / self._hbm
        return max(compute, memory) + self._overhead

    def load_seconds(self, tokens_by_tier: list[int]) -> float:
        """Move KV of `tokens_by_tier[t]` tokens from each slower tier t up to the device."""
        host, disk = tokens_by_tier[Tier.HOST], tokens_by_tier[Tier.DISK]
        seconds = self.profile.load_latency_ms / 1e3 + (host + disk) * self.kv_bytes / self._pcie
        if disk:
            seconds += self.profile.disk_latency_ms / 1e3 + disk * self.kv_bytes / self._disk
        return seconds

    def tokens_per_second_pcie(self) -> float:
        return self._pcie / self.kv_bytes
