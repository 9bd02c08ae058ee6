"""Instance-to-instance KV links for the simulator: bandwidth (one direction) and latency.

Order-of-magnitude figures from vendor datasheets, for comparing routers, not for predicting
a particular cluster (pass `Link(...)` with measured numbers for that):
- nvlink-h100: NVLink 4 on H100 SXM, 900 GB/s per GPU both directions -> 450 GB/s one way
  (NVIDIA H100 datasheet); an instance of several GPUs moves each GPU's KV shard in parallel,
  so the link scales with the GPUs per instance;
- nvlink-a6000: the 2-way NVLink bridge of RTX A6000, 112.5 GB/s both directions -> 56 GB/s one
  way (NVIDIA RTX A6000 datasheet); it joins GPU pairs only, so between two TP-4 instances on one
  node KV crosses PCIe 4.0 x16 (~25 GB/s achieved) unless a bridge pairs the two GPUs;
- rdma: one 400 Gb/s InfiniBand/RoCE NIC (ConnectX-7) = 50 GB/s, per GPU when each has its own;
- tcp: 25 GbE = ~3 GB/s, shared by the instance, with ~100 us of software latency;
- nvme: the shared KV tier on one NVMe SSD (PCIe 4.0 x4, ~7 GB/s sequential read; 5 GB/s
  taken), shared by the instance, ~100 us per read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float            # GB/s, one direction, per GPU of the instance unless `shared`
    latency_s: float
    shared: bool = False   # one link for the whole instance (a NIC), not one per GPU

    def seconds(self, nbytes: float, gpus: int = 1) -> float:
        bw = self.gbps * 1e9 * (1 if self.shared else max(1, gpus))
        return self.latency_s + nbytes / bw if nbytes > 0 else 0.0


LINKS = {
    "nvlink-h100": Link("nvlink-h100", 450.0, 5e-6),
    "nvlink-a6000": Link("nvlink-a6000", 56.0, 5e-6),
    "pcie4": Link("pcie4", 25.0, 1e-5),
    "rdma": Link("rdma", 50.0, 1e-5),
    "tcp": Link("tcp", 3.1, 1e-4, shared=True),
    "nvme": Link("nvme", 5.0, 1e-4, shared=True),
}


def get_link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known links: {', '.join(LINKS)}") from None
