//! The target description: what each backend kiln lowers for is, and the
//! measured rates the cost model and the memory planners price work by, in
//! one place. Lowering reads [`LowerTarget`] (which calls a backend has, what
//! its compiler keeps); the cost model and the planners read the rooflines
//! ([`Target`]), the kernel model's achieved rates and the host link.
//!
//! Invariants: constants only, no behaviour beyond answering questions about
//! a target; every figure says where it was measured; nothing here imports
//! another module of the compiler but the IR.
//!
//! The CPU target is priced by the H100's roofline and kernel rates: kiln's
//! memory planner runs on the CPU plugin in tests and CI to check the plans
//! it makes for GPUs, and the CPU plugin's memory is judged by its own fusion
//! model (`memory::XlaCpuFusion`), not by these rates.

/// The XLA backend a module is lowered for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LowerTarget {
    #[default]
    Cpu,
    Cuda,
}

impl LowerTarget {
    /// From a PJRT client's platform name (`cpu`, `cuda`, `gpu`).
    pub fn from_platform(name: &str) -> LowerTarget {
        match name.to_ascii_lowercase().as_str() {
            "cuda" | "gpu" => LowerTarget::Cuda,
            _ => LowerTarget::Cpu,
        }
    }

    /// Whether the backend keeps `optimization_barrier`s through its CSE and
    /// scheduling. XLA's CPU pipeline removes them before a CSE pass
    /// (`docs/memory.md`), so ordering there needs a data dependence
    /// ([`crate::fence`]).
    pub fn keeps_barriers(self) -> bool {
        match self {
            LowerTarget::Cpu => false,
            LowerTarget::Cuda => true,
        }
    }

    /// Whether a program is compiled in its own order (the runtime's
    /// `CompileOptions::keep_order`): one with a remat plan (`planned`) and
    /// collectives (partitions or replicas) on CUDA, where XLA's
    /// latency-hiding scheduler reorders the backward around the collectives
    /// and undoes the plan (`docs/memory-journal.md`, "Remat with collectives on
    /// GPUs"). The CPU plugin's programs keep their plans.
    pub fn keeps_plan_order(self, planned: bool, collectives: bool) -> bool {
        planned && collectives && self == LowerTarget::Cuda
    }
}

/// Which of a target's peak FLOP/s bounds a node's arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeakClass {
    /// `dot_general` in bf16 or f16 (dense tensor cores).
    Bf16Matmul,
    /// `dot_general` in f32, run as TF32 on tensor cores (XLA's default on
    /// NVIDIA GPUs; kiln's benchmarks allow it). A target without TF32 sets
    /// its TF32 peak to its f32 one.
    Tf32Matmul,
    /// Everything else: elementwise, reductions, integer and f64 dots, on the
    /// vector (non-tensor-core) units.
    Vector,
}

/// Peak rates of one device, the roofline's ceilings. Units are in the names.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// Short identifier (`h100_sxm`), used as a key in reports.
    pub name: &'static str,
    /// Dense bf16/f16 tensor-core FLOP/s.
    pub peak_bf16_flops_per_s: f64,
    /// Dense TF32 tensor-core FLOP/s (f32 `dot_general`).
    pub peak_tf32_flops_per_s: f64,
    /// f32 FLOP/s without tensor cores (elementwise, reductions, other dots).
    pub peak_f32_flops_per_s: f64,
    /// Device memory bandwidth, bytes per second.
    pub mem_bytes_per_s: f64,
    /// Bandwidth to the other replicas, bytes per second in one direction.
    pub interconnect_bytes_per_s: f64,
}

impl Target {
    /// NVIDIA H100 SXM5 80GB, datasheet values: dense bf16 989 TFLOP/s, TF32
    /// 494 TFLOP/s, f32 67 TFLOP/s, HBM3 3.35 TB/s, NVLink 4 at 900 GB/s
    /// both directions together (450e9 one way).
    pub const H100_SXM: Target = Target {
        name: "h100_sxm",
        peak_bf16_flops_per_s: 989e12,
        peak_tf32_flops_per_s: 494e12,
        peak_f32_flops_per_s: 67e12,
        mem_bytes_per_s: 3.35e12,
        interconnect_bytes_per_s: 450e9,
    };

    /// The lent H100 as measured (`benches/RESULTS.md`, "kiln's targets", 2026-11-22): a bf16 matmul
    /// reached 798 TFLOP/s and a copy 3.0 TB/s. TF32, f32 and NVLink were not
    /// measured; they keep the datasheet values.
    pub const H100_SXM_MEASURED: Target = Target {
        name: "h100_sxm_measured",
        peak_bf16_flops_per_s: 798e12,
        mem_bytes_per_s: 3.0e12,
        ..Target::H100_SXM
    };

    /// NVIDIA H200 SXM 141GB, datasheet values: the same GH100 compute as the
    /// H100 SXM (989 / 494 / 67 TFLOP/s), HBM3e at 4.8 TB/s, NVLink 4.
    pub const H200_SXM: Target = Target {
        name: "h200_sxm",
        peak_bf16_flops_per_s: 989e12,
        peak_tf32_flops_per_s: 494e12,
        peak_f32_flops_per_s: 67e12,
        mem_bytes_per_s: 4.8e12,
        interconnect_bytes_per_s: 450e9,
    };

    /// Every built-in target, for reports.
    pub const ALL: [Target; 3] = [Target::H100_SXM, Target::H100_SXM_MEASURED, Target::H200_SXM];

    /// The peak that bounds arithmetic of `class`.
    pub fn peak_flops_per_s(&self, class: PeakClass) -> f64 {
        match class {
            PeakClass::Bf16Matmul => self.peak_bf16_flops_per_s,
            PeakClass::Tf32Matmul => self.peak_tf32_flops_per_s,
            PeakClass::Vector => self.peak_f32_flops_per_s,
        }
    }
}

/// The shortest kernel: what a tiny elementwise kernel took on the H100
/// (2026-11-23 trace of the gpt2-small step: 1.3–1.4 µs for the bf16 copies
/// of the bias vectors).
pub const MIN_KERNEL_SECONDS: f64 = 1.4e-6;

/// The share of the target's bandwidth a kernel's traffic moves at: the
/// H100's recomputed GELU outputs (read 48 MiB, write 48 MiB) took 42 µs,
/// 2.4 TB/s, and its bf16 weight copies 2.6 TB/s, against the 3.0 TB/s of
/// [`Target::H100_SXM_MEASURED`] (2026-11-23 trace of the 50% plan,
/// `docs/memory-journal.md`, "Achieved rates in the kernel model").
pub const ACHIEVED_BANDWIDTH: f64 = 0.82;

/// The share of the target's peak a GEMM's arithmetic runs at: the H100's
/// recomputed MLP up-projections (8192×768×3072, bf16) took 55 µs, 703
/// TFLOP/s against the 798 of [`Target::H100_SXM_MEASURED`] (the same
/// trace).
pub const ACHIEVED_GEMM: f64 = 0.88;

/// The share of the target's bf16 peak cuDNN's flash-attention forward runs
/// its two matmuls at: 46.8 µs a call for gpt2-small's causal [8, 12, 1024,
/// 64] (12.9 GFLOP counting the unmasked half), 275 TFLOP/s against the 798
/// of [`Target::H100_SXM_MEASURED`] (2026-11-24 trace of the unplanned step,
/// `docs/memory-journal.md`, "The attention's rate and a passed anchor"). Priced as a GEMM, a recomputed attention looked 2.5
/// times cheaper than it ran.
pub const ACHIEVED_ATTENTION_FORWARD: f64 = 0.345;

/// The same for the flash-attention backward's five matmuls: 154.7 µs a call
/// with its `dO·O` row sums and its dq conversion (32.2 GFLOP), 208 TFLOP/s.
pub const ACHIEVED_ATTENTION_BACKWARD: f64 = 0.261;

/// The workspace XLA gives every cuBLAS GEMM on Hopper (`s8[33554432]`, a
/// second output of each `__cublas$lt$matmul` call).
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// What one direction of the H100's host link carries while the other
/// carries as much: 46.5 GB/s measured with pinned buffers (54.7 GB/s one
/// way alone), less a margin for the copies' setup.
pub const HOST_LINK_BYTES_PER_SECOND: f64 = 45e9;

/// The host link's rate [`HostCopies`] plans for by default, each way, in
/// bytes per second of the kernel model's time. Pinned copies on the H200
/// measured 54.7 GB/s one way (46.5 each way at once), but the link is
/// priced against the model's kernel times, and the model runs gpt2-small's
/// forward in 5.31 ms where CUPTI measured 4.24 (its backward 1.18× over):
/// 54.7 GB/s of wall time is 43.7 GB/s of model time in the forward. At
/// 45 GB/s the link carried more before the LM head than the device can, so
/// XLA's stream waited for copies; 40 leaves a margin (docs/memory-journal.md,
/// "Host copies honest about the link").
pub const HOST_COPY_LINK_BYTES_PER_SECOND: f64 = 40e9;

/// What one value's trip out and back adds to the step beyond the model's
/// kernels, in seconds: its four custom calls' launches and waits, and the
/// fusions XLA splits around them. Measured on the H200 (gpt2-small bf16,
/// docs/memory-journal.md, "What a copy costs"): with greedy's own ratio of device
/// to model time at a nearby budget in the same call taken out, the 16
/// copies of the 22%, 50% and 49% plans ran 22–25, 30 and 41 µs a copy over
/// their model.
pub const HOST_COPY_TRIP_SECONDS: f64 = 30e-6;
