//! The small, `Copy` parts of an [`Op`](super::Op): the sub-enums that name
//! an elementwise op, a comparison, a reduction, a generator or a memory
//! space (each knows its text-form name and its StableHLO mnemonic), and the
//! attribute structs of `dot_general` and of the attention composite.
//!
//! Invariant: plain data, hashable and ordered, so that ops stay hashable
//! and two structurally equal programs hash alike.

use super::DType;

/// Elementwise ops of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Log1p,
    Expm1,
    Tanh,
    Logistic,
    Sqrt,
    Rsqrt,
    Sin,
    Cos,
    Floor,
    Ceil,
    Sign,
    /// Logical not on pred, bitwise not on integers.
    Not,
    /// The error function (CHLO `erf`, expanded by XLA).
    Erf,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 17] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Log1p,
        UnaryOp::Expm1,
        UnaryOp::Tanh,
        UnaryOp::Logistic,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Sign,
        UnaryOp::Not,
        UnaryOp::Erf,
    ];

    /// Name in kiln's text form.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Log1p => "log1p",
            UnaryOp::Expm1 => "expm1",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Logistic => "logistic",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Sign => "sign",
            UnaryOp::Not => "not",
            UnaryOp::Erf => "erf",
        }
    }

    /// The MLIR op this lowers to.
    pub fn mnemonic(self) -> &'static str {
        match self {
            UnaryOp::Neg => "stablehlo.negate",
            UnaryOp::Abs => "stablehlo.abs",
            UnaryOp::Exp => "stablehlo.exponential",
            UnaryOp::Log => "stablehlo.log",
            UnaryOp::Log1p => "stablehlo.log_plus_one",
            UnaryOp::Expm1 => "stablehlo.exponential_minus_one",
            UnaryOp::Tanh => "stablehlo.tanh",
            UnaryOp::Logistic => "stablehlo.logistic",
            UnaryOp::Sqrt => "stablehlo.sqrt",
            UnaryOp::Rsqrt => "stablehlo.rsqrt",
            UnaryOp::Sin => "stablehlo.sine",
            UnaryOp::Cos => "stablehlo.cosine",
            UnaryOp::Floor => "stablehlo.floor",
            UnaryOp::Ceil => "stablehlo.ceil",
            UnaryOp::Sign => "stablehlo.sign",
            UnaryOp::Not => "stablehlo.not",
            UnaryOp::Erf => "chlo.erf",
        }
    }

    /// Whether the op is defined only on floating-point operands.
    pub fn float_only(self) -> bool {
        match self {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Not => false,
            UnaryOp::Exp
            | UnaryOp::Log
            | UnaryOp::Log1p
            | UnaryOp::Expm1
            | UnaryOp::Tanh
            | UnaryOp::Logistic
            | UnaryOp::Sqrt
            | UnaryOp::Rsqrt
            | UnaryOp::Sin
            | UnaryOp::Cos
            | UnaryOp::Floor
            | UnaryOp::Ceil
            | UnaryOp::Erf => true,
        }
    }
}

/// Elementwise ops of two operands of the same type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Rem,
    And,
    Or,
    Xor,
    /// `lhs >> rhs` on the bits, zeros shifted in; an amount of the bit
    /// width or more gives 0 (integers only, not differentiable).
    ShiftRightLogical,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 12] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Rem,
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
        BinaryOp::ShiftRightLogical,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Rem => "rem",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::ShiftRightLogical => "shift_right_logical",
        }
    }

    pub fn mnemonic(self) -> &'static str {
        match self {
            BinaryOp::Add => "stablehlo.add",
            BinaryOp::Sub => "stablehlo.subtract",
            BinaryOp::Mul => "stablehlo.multiply",
            BinaryOp::Div => "stablehlo.divide",
            BinaryOp::Pow => "stablehlo.power",
            BinaryOp::Max => "stablehlo.maximum",
            BinaryOp::Min => "stablehlo.minimum",
            BinaryOp::Rem => "stablehlo.remainder",
            BinaryOp::And => "stablehlo.and",
            BinaryOp::Or => "stablehlo.or",
            BinaryOp::Xor => "stablehlo.xor",
            BinaryOp::ShiftRightLogical => "stablehlo.shift_right_logical",
        }
    }

    /// Logical/bitwise ops take pred or integers only (shifts: integers
    /// only, [`BinaryOp::is_shift`]).
    pub fn is_logical(self) -> bool {
        match self {
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor | BinaryOp::ShiftRightLogical => true,
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Pow
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::Rem => false,
        }
    }

    /// Bit shifts: integers only (not pred).
    pub fn is_shift(self) -> bool {
        self == BinaryOp::ShiftRightLogical
    }
}

/// Comparison direction; the result is `pred`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CompareDir {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CompareDir {
    pub const ALL: [CompareDir; 6] =
        [CompareDir::Eq, CompareDir::Ne, CompareDir::Lt, CompareDir::Le, CompareDir::Gt, CompareDir::Ge];

    /// `EQ`, `NE`, ... as StableHLO's `comparison_direction` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CompareDir::Eq => "EQ",
            CompareDir::Ne => "NE",
            CompareDir::Lt => "LT",
            CompareDir::Le => "LE",
            CompareDir::Gt => "GT",
            CompareDir::Ge => "GE",
        }
    }
}

/// Reduction monoids (also used by `all_reduce`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    Prod,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }

    /// The binary op that combines two partial results.
    pub fn combiner(self) -> BinaryOp {
        match self {
            ReduceOp::Sum => BinaryOp::Add,
            ReduceOp::Max => BinaryOp::Max,
            ReduceOp::Min => BinaryOp::Min,
            ReduceOp::Prod => BinaryOp::Mul,
        }
    }

    /// The identity element of the monoid for `dtype`.
    pub fn identity(self, dtype: DType) -> f64 {
        match self {
            ReduceOp::Sum => 0.0,
            ReduceOp::Prod => 1.0,
            ReduceOp::Max => lowest(dtype),
            ReduceOp::Min => highest(dtype),
        }
    }
}

fn lowest(dtype: DType) -> f64 {
    match dtype {
        DType::Pred | DType::U8 | DType::U32 | DType::U64 => 0.0,
        DType::I8 => f64::from(i8::MIN),
        DType::I32 => f64::from(i32::MIN),
        DType::I64 => i64::MIN as f64,
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => f64::NEG_INFINITY,
    }
}

fn highest(dtype: DType) -> f64 {
    match dtype {
        DType::Pred => 1.0,
        DType::U8 => f64::from(u8::MAX),
        DType::U32 => f64::from(u32::MAX),
        DType::U64 => u64::MAX as f64,
        DType::I8 => f64::from(i8::MAX),
        DType::I32 => f64::from(i32::MAX),
        DType::I64 => i64::MAX as f64,
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => f64::INFINITY,
    }
}

/// Bit-generator algorithm of `rng_bit_generator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RngAlgorithm {
    ThreeFry,
    Philox,
}

impl RngAlgorithm {
    pub fn name(self) -> &'static str {
        match self {
            RngAlgorithm::ThreeFry => "THREE_FRY",
            RngAlgorithm::Philox => "PHILOX",
        }
    }
}

/// One step of a value's trip to pinned host memory and back over copies of
/// kiln's own ([`Op::HostCopy`]), in trip order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostCopyStep {
    /// `(value, ties...) -> token`: start copying the value out.
    Out,
    /// `(value, token, ties...) -> token`: the copy out has ended; the value's
    /// device buffer may be reused after this.
    OutDone,
    /// `(token, ties...) -> value`: start copying the value back into a new
    /// device buffer.
    In,
    /// `(value, ties...) -> value` (the same buffer): the copy back has ended.
    InDone,
}

impl HostCopyStep {
    /// Every step, in trip order.
    pub const ALL: [HostCopyStep; 4] =
        [HostCopyStep::Out, HostCopyStep::OutDone, HostCopyStep::In, HostCopyStep::InDone];

    /// Name in kiln's text form.
    pub fn name(self) -> &'static str {
        match self {
            HostCopyStep::Out => "out",
            HostCopyStep::OutDone => "out_done",
            HostCopyStep::In => "in",
            HostCopyStep::InDone => "in_done",
        }
    }

    /// The custom-call target the step lowers to (the runtime registers a
    /// handler under each name, `kiln_runtime::pjrt::host_copy::TARGETS`).
    pub fn target(self) -> &'static str {
        match self {
            HostCopyStep::Out => "kiln_host_copy_out",
            HostCopyStep::OutDone => "kiln_host_copy_out_done",
            HostCopyStep::In => "kiln_host_copy_in",
            HostCopyStep::InDone => "kiln_host_copy_in_done",
        }
    }

    /// Whether the step's result is a token (`ui64[]`) rather than the value.
    pub fn makes_token(self) -> bool {
        matches!(self, HostCopyStep::Out | HostCopyStep::OutDone)
    }
}

/// Where a value's buffer lives ([`Op::Place`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemorySpace {
    /// The accelerator's own memory, where every value lives unless placed.
    Device,
    /// Page-locked host memory the accelerator's copy engines read and write.
    PinnedHost,
}

impl MemorySpace {
    /// Name in kiln's text form and in XLA's `_xla_buffer_placement` attribute.
    pub fn name(self) -> &'static str {
        match self {
            MemorySpace::Device => "device",
            MemorySpace::PinnedHost => "pinned_host",
        }
    }
}

/// Dimension numbers of a `dot_general`: batch dimensions pair up and lead the
/// result; contracting dimensions pair up and are summed over; the remaining
/// (free) dimensions of lhs then rhs follow in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DotDims {
    pub lhs_batch: Vec<usize>,
    pub rhs_batch: Vec<usize>,
    pub lhs_contract: Vec<usize>,
    pub rhs_contract: Vec<usize>,
}

impl DotDims {
    /// Plain matrix product `[m, k] x [k, n]`.
    pub fn matmul() -> DotDims {
        DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![0] }
    }
}

/// How the query heads of an attention share fewer key/value heads: with
/// `hq` query and `hkv` key/value heads (`g = hq / hkv`), query head `i` reads
/// key/value head `i / g` (`Grouped`: grouped-query attention as Llama's
/// `repeat_kv` and cuDNN spell it, copies made by broadcast + reshape) or
/// `i % hkv` (`Tiled`: copies made by concatenating the whole set `g` times).
/// With as many key/value heads as query heads both read head `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvHeads {
    Grouped,
    Tiled,
}

impl KvHeads {
    /// The key/value head query head `i` reads, of `hkv` among `hq`.
    pub fn source(self, i: usize, hq: usize, hkv: usize) -> usize {
        match self {
            KvHeads::Grouped => i / (hq / hkv),
            KvHeads::Tiled => i % hkv,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvHeads::Grouped => "grouped",
            KvHeads::Tiled => "tiled",
        }
    }
}

/// Attributes of the attention composite:
/// `softmax(mask(scale · q kᵀ + Σ bias)) v` (`docs/composites.md`). Floats are
/// kept as their f64 bits so the attributes stay hashable and ordered (two
/// composites with the same attributes merge under CSE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttentionAttrs {
    pub scale_bits: u64,
    /// Query `i` sees keys `0..=i` only.
    pub causal: bool,
    /// The value a score takes where the `mask` operand does not keep it
    /// (f64 bits; the spelling's own value, `-inf` or a large negative).
    pub fill_bits: u64,
    /// The `mask` value that keeps a score (`where(m, s, fill)` keeps where
    /// `m` is true, `where(m, fill, s)` where it is false).
    pub keep: bool,
    /// How query heads read fewer key/value heads.
    pub kv_heads: KvHeads,
    /// `k` is given transposed, `[b, hkv, d, s]` (a spelling whose `kᵀ` was
    /// converted after the transpose: the composite reads it as it is).
    pub k_transposed: bool,
}

impl AttentionAttrs {
    /// Scale and causality; no mask fill (`-inf`), grouped heads, `k` as
    /// `[b, hkv, s, d]`.
    pub fn new(scale: f64, causal: bool) -> AttentionAttrs {
        AttentionAttrs {
            scale_bits: scale.to_bits(),
            causal,
            fill_bits: f64::NEG_INFINITY.to_bits(),
            keep: true,
            kv_heads: KvHeads::Grouped,
            k_transposed: false,
        }
    }

    pub fn scale(self) -> f64 {
        f64::from_bits(self.scale_bits)
    }

    pub fn fill(self) -> f64 {
        f64::from_bits(self.fill_bits)
    }

    /// The same attributes with masked scores taking `fill`, kept where the
    /// mask is `keep`.
    pub fn with_mask(self, fill: f64, keep: bool) -> AttentionAttrs {
        AttentionAttrs { fill_bits: fill.to_bits(), keep, ..self }
    }
}
