//! On-device initialisation: the init program that computes parameters from
//! the seed where they will live, with the values host init would give.
//!
//! Host init ([`super::HostRng`]) draws SplitMix64 outputs in sequence, and
//! SplitMix64 is counter-based: draw `k` of seed `s` is `mix(s + (k + 1)·γ)`.
//! A parameter whose draws start at `first_draw` in its store's stream is
//! therefore a pure elementwise function of the seed and each element's index,
//! which this module records as ordinary lazy ops (`iota`, wrapping `u64`
//! arithmetic, the f64 transforms, one conversion to f32). `ParamStore`
//! records them while a model is built and runs them as one step
//! ([`super::ParamStore::materialize`]): an ordinary kiln program through the
//! same pipeline and compile cache as a training step.
//!
//! Invariants:
//! - Value-equal to host init: the integer bits are the same (wrapping `u64`
//!   `+ * ^` and logical shifts right are exact on both sides); the
//!   float transform is the host's, op for op in f64, rounded once to f32
//!   at the end. What may differ is a transcendental's last f64 bit (the
//!   backend's `log`/`cos` against the host's libm) or a fused multiply-add
//!   that the backend contracts; either changes the f32 result only when the
//!   f64 value lies within an ulp of an f32 rounding tie (`docs/init.md`
//!   gives the measured difference).
//! - Independent of where it runs: an element depends only on its global
//!   index, computed from one `iota` per axis times that axis' stride, never
//!   on a replica or partition id. The same program gives the same values on
//!   any number of replicas, and a partitioner that splits the result splits
//!   the iotas with it (no full copy anywhere).
//! - One program per list of shapes and kinds, not per seed or offset: each
//!   random parameter's key (`seed + (first_draw + 1)·γ`, computed on the
//!   host), its scale (`std`, or `lo` and `hi - lo`) and the shift amounts
//!   ([`Shifts`]) are scalar parameters of the program; no data of any shape
//!   is uploaded.
//! - Two forms ([`InitForm`]) with the same values: per parameter, or (the
//!   default, applied by `ParamStore::prepare_init`) one flat computation per
//!   run of normal parameters with consecutive draws ([`normal_run`]), which
//!   XLA compiles to one kernel with the transcendentals instead of one per
//!   parameter. Sharded parameters keep the per-parameter form.
//! - Nothing here reads a device or cuts a step: it only records.

use kiln_compiler::ir::{BinaryOp, DType, Literal, Op, Shape, TensorType};

use crate::core::error::Result;
use crate::core::tensor::Tensor;
use crate::engine::context;

/// SplitMix64's increment (the golden ratio in 64 bits).
pub(crate) const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// How a parameter's initial value is made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in `[-bound, bound)`: one draw per element.
    Uniform { bound: f64 },
    /// Normal with mean 0 and standard deviation `std` (Box–Muller): two
    /// draws per element.
    Normal { std: f64 },
    /// Every element `value`: no draws.
    Constant { value: f32 },
    /// A tensor the caller made ([`super::ParamStore::add`]): no draws.
    Given,
}

impl Init {
    /// Draws of the seed's stream one element takes.
    pub fn draws_per_element(self) -> u64 {
        match self {
            Init::Uniform { .. } => 1,
            Init::Normal { .. } => 2,
            Init::Constant { .. } | Init::Given => 0,
        }
    }
}

/// One parameter as its store made it: enough to make it again, anywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Shape,
    pub init: Init,
    /// Index, in the seed's stream, of the parameter's first draw (elements
    /// draw in row-major order; a normal element takes draws `2i` and `2i+1`).
    pub first_draw: u64,
}

/// Where a [`super::ParamStore`] computes its parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum InitPlacement {
    /// On the host, as data uploaded by the first step (works on every
    /// backend; the reference and eager backends' only choice).
    #[default]
    Host,
    /// In a compiled init program on the devices: nothing but the seed
    /// travels from the host.
    Device,
}

impl InitPlacement {
    /// `host` or `device` (the CLI's `--init`).
    pub fn parse(s: &str) -> Option<InitPlacement> {
        match s {
            "host" => Some(InitPlacement::Host),
            "device" => Some(InitPlacement::Device),
            _ => None,
        }
    }
}

/// Records `spec`'s initial value (f32 of `spec.shape`) from `seed`.
pub fn init_value(seed: u64, spec: &ParamSpec) -> Result<Tensor> {
    let shape = &spec.shape;
    // The state before the parameter's first draw (SplitMix64 adds γ first).
    let key = Tensor::from_literal(u64_literal(seed.wrapping_add(spec.first_draw.wrapping_add(1).wrapping_mul(GAMMA))));
    let input = |v: f64| Tensor::scalar(v).broadcast_to(shape.clone());
    match spec.init {
        Init::Uniform { bound } => {
            let (lo, hi) = (-bound, bound);
            // Host: `(lo + (hi - lo) * u) as f32`.
            let shifts = Shifts::new()?;
            let u = uniform01(&draws(&key, 1, 0, shape, &shifts)?, &shifts)?;
            u.mul(&input(hi - lo)?)?.add(&input(lo)?)?.to_dtype(DType::F32)
        }
        Init::Normal { std } => {
            // Host Box–Muller: u1 = 1 - uniform(), u2 = uniform(), in that order.
            let shifts = Shifts::new()?;
            let u1 = uniform01(&draws(&key, 2, 0, shape, &shifts)?, &shifts)?;
            let u2 = uniform01(&draws(&key, 2, 1, shape, &shifts)?, &shifts)?;
            let one_minus = Tensor::full(1.0, DType::F64, shape.clone())?.sub(&u1)?;
            let r = one_minus.log()?.mul_scalar(-2.0)?.sqrt()?;
            let c = u2.mul_scalar(std::f64::consts::TAU)?.cos()?;
            r.mul(&c)?.mul(&input(std)?)?.to_dtype(DType::F32)
        }
        Init::Constant { value } => own_full(value, shape),
        Init::Given => Err(crate::core::error::FrontendError::InvalidArgument {
            op: "init_value",
            reason: format!("parameter {} was given as data; it has no init to run", spec.name),
        }),
    }
}

/// How the init program computes a store's normal parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitForm {
    /// Parameters of consecutive draws are one Box–Muller computation over
    /// a flat index, fenced, then sliced per parameter: one kernel with the
    /// transcendentals for the whole run (the default).
    Flat,
    /// Each parameter its own computation over its per-axis index: the form
    /// a sharded parameter keeps (its shard computes only its indices).
    PerParameter,
}

/// Env var choosing [`InitForm`] (`flat` or `per-parameter`) for stores
/// that set none; meant for measuring the two
/// (`benches/examples/init_setup.rs`), not for tuning.
pub const ENV_INIT_FORM: &str = "KILN_INIT_FORM";

impl InitForm {
    /// `KILN_INIT_FORM`, else [`InitForm::Flat`].
    pub fn from_env() -> Result<InitForm> {
        match kiln_runtime::env::string_var(ENV_INIT_FORM)?.as_deref().map(str::trim) {
            None | Some("") | Some("flat") => Ok(InitForm::Flat),
            Some("per-parameter") => Ok(InitForm::PerParameter),
            Some(other) => Err(crate::core::error::FrontendError::BadEnv {
                var: ENV_INIT_FORM,
                value: other.to_string(),
                expected: "flat or per-parameter",
            }),
        }
    }
}

/// Records the values of `run`, normal parameters whose draws follow each
/// other in the seed's stream (`first_draw` of each is the end of the one
/// before), as one computation: the standard normals of the whole run over
/// one flat index, times each element's `std`, rounded to f32, then an
/// optimization barrier, then a slice and reshape per parameter. Value-equal
/// to [`init_value`] of each spec (the same draws and the same f64 ops: the
/// host's `f32(std · normal)`); the barrier keeps XLA from fusing the
/// transcendentals into every slice, which would give back one kernel per
/// parameter. The flat index is not per axis, so a sharded parameter must
/// not be made here (the run would be computed whole on every device).
/// Temporary memory: 4 bytes per element of the run.
pub(crate) fn normal_run(seed: u64, run: &[&ParamSpec]) -> Result<Vec<Tensor>> {
    let Some(first) = run.first() else { return Ok(Vec::new()) };
    let mut stds = Vec::with_capacity(run.len());
    let mut end = first.first_draw;
    for spec in run {
        let Init::Normal { std } = spec.init else {
            return Err(crate::core::error::FrontendError::InvalidArgument {
                op: "init",
                reason: format!("{} is not a normal parameter; a normal run takes only those", spec.name),
            });
        };
        if spec.first_draw != end {
            return Err(crate::core::error::FrontendError::InvalidArgument {
                op: "init",
                reason: format!(
                    "{} starts at draw {}, not {end}: its draws do not follow the run's",
                    spec.name, spec.first_draw
                ),
            });
        }
        end = end.wrapping_add(2u64.wrapping_mul(spec.shape.num_elements() as u64));
        stds.push(std);
    }
    let total: usize = run.iter().map(|s| s.shape.num_elements()).sum();
    let flat = Shape::from(vec![total]);
    let key =
        Tensor::from_literal(u64_literal(seed.wrapping_add(first.first_draw.wrapping_add(1).wrapping_mul(GAMMA))));
    let shifts = Shifts::new()?;
    let u1 = uniform01(&draws(&key, 2, 0, &flat, &shifts)?, &shifts)?;
    let u2 = uniform01(&draws(&key, 2, 1, &flat, &shifts)?, &shifts)?;
    let one_minus = Tensor::full(1.0, DType::F64, flat.clone())?.sub(&u1)?;
    let r = one_minus.log()?.mul_scalar(-2.0)?.sqrt()?;
    let c = u2.mul_scalar(std::f64::consts::TAU)?.cos()?;
    // Each element's std: a select per change of std along the run (a GPT
    // has two values, alternating), the values as scalar inputs.
    let index = linear_index(&flat)?;
    let mut scale = Tensor::scalar(stds[0]).broadcast_to(flat.clone())?;
    let mut offset = 0usize;
    for (i, spec) in run.iter().enumerate() {
        if i > 0 && stds[i].to_bits() != stds[i - 1].to_bits() {
            let from_here = index.ge(&u64_full(offset as u64, &flat)?)?;
            scale = Tensor::where_cond(&from_here, &Tensor::scalar(stds[i]).broadcast_to(flat.clone())?, &scale)?;
        }
        offset += spec.shape.num_elements();
    }
    let values = r.mul(&c)?.mul(&scale)?.to_dtype(DType::F32)?;
    let values = Tensor::optimization_barrier(&[values])?.swap_remove(0);
    let mut out = Vec::with_capacity(run.len());
    let mut offset = 0usize;
    for spec in run {
        let n = spec.shape.num_elements();
        out.push(values.slice(vec![offset], vec![offset + n], vec![1])?.reshape(spec.shape.clone())?);
        offset += n;
    }
    Ok(out)
}

/// SplitMix64 outputs of draws `first + step·i + lane` for each element `i`
/// (row-major) of `shape`, from `key = seed + (first + 1)·γ`.
fn draws(key: &Tensor, step: u64, lane: u64, shape: &Shape, shifts: &Shifts) -> Result<Tensor> {
    // state = seed + (k + 1)·γ with k = first + lane + step·i: the key, a
    // lane constant and a per-element multiple of the index.
    let mut state = key.broadcast_to(shape.clone())?;
    if lane != 0 {
        state = state.add(&u64_full(lane.wrapping_mul(GAMMA), shape)?)?;
    }
    let state = state.add(&linear_index(shape)?.mul(&u64_full(step.wrapping_mul(GAMMA), shape)?)?)?;
    mix(&state, shape, shifts)
}

/// SplitMix64's output function (its shifts right as [`Shifts`] says).
fn mix(z: &Tensor, shape: &Shape, shifts: &Shifts) -> Result<Tensor> {
    let z = xor_shift(z, &shifts.by30, shifts.form)?.mul(&u64_full(MIX1, shape)?)?;
    let z = xor_shift(&z, &shifts.by27, shifts.form)?.mul(&u64_full(MIX2, shape)?)?;
    xor_shift(&z, &shifts.by31, shifts.form)
}

/// The right shifts of SplitMix64 (by 30, 27, 31) and of `uniform01` (by
/// 11), as [`ShiftForm`] says: by default `shift_right_logical` by amounts
/// that are `u64` scalar inputs of the program, not constants. Measured on
/// the H100 (`docs/init.md`): the CUDA plugin spent seconds per 100 M
/// elements before its compile proper on a `u64` divide by a constant of a
/// large shape (the flat gpt2-small program took 13–20 s, its integer part
/// alone 6.9 s), while the same ops with the divisor out of sight compiled in
/// 0.1–0.3 s, at the price of a true 64-bit division at run time.
struct Shifts {
    form: ShiftForm,
    by30: Tensor,
    by27: Tensor,
    by31: Tensor,
    by11: Tensor,
}

/// How the init program shifts right (`KILN_INIT_SHIFTS`; for measuring the
/// forms, not for tuning): the values are the same in every form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ShiftForm {
    /// `shift_right_logical` by scalar inputs (`input`, the default).
    Input,
    /// `shift_right_logical` by constants (`constant`).
    Constant,
    /// Division by `2^bits` given as scalar inputs (`divide`, the form
    /// before the shift op existed).
    Divide,
}

/// Env var choosing [`ShiftForm`]: `input`, `constant` or `divide`.
const ENV_INIT_SHIFTS: &str = "KILN_INIT_SHIFTS";

impl ShiftForm {
    fn from_env() -> Result<ShiftForm> {
        match kiln_runtime::env::string_var(ENV_INIT_SHIFTS)?.as_deref().map(str::trim) {
            None | Some("") | Some("input") => Ok(ShiftForm::Input),
            Some("constant") => Ok(ShiftForm::Constant),
            Some("divide") => Ok(ShiftForm::Divide),
            Some(other) => Err(crate::core::error::FrontendError::BadEnv {
                var: ENV_INIT_SHIFTS,
                value: other.to_string(),
                expected: "input, constant or divide",
            }),
        }
    }
}

impl Shifts {
    fn new() -> Result<Shifts> {
        let form = ShiftForm::from_env()?;
        let input = |bits: u32| -> Result<Tensor> {
            Ok(match form {
                ShiftForm::Input => Tensor::from_literal(u64_literal(u64::from(bits))),
                ShiftForm::Constant => u64_full(u64::from(bits), &Shape::scalar())?,
                ShiftForm::Divide => Tensor::from_literal(u64_literal(1u64 << bits)),
            })
        };
        Ok(Shifts { form, by30: input(30)?, by27: input(27)?, by31: input(31)?, by11: input(11)? })
    }
}

/// `z >> bits`, `amount` being what [`Shifts`] holds for `bits`.
fn shift_right(z: &Tensor, amount: &Tensor, form: ShiftForm) -> Result<Tensor> {
    let amount = amount.broadcast_to(z.shape().clone())?;
    match form {
        ShiftForm::Input | ShiftForm::Constant => z.binary(BinaryOp::ShiftRightLogical, &amount),
        // Exact on unsigned integers.
        ShiftForm::Divide => z.binary(BinaryOp::Div, &amount),
    }
}

/// `z ^ (z >> bits)`.
fn xor_shift(z: &Tensor, amount: &Tensor, form: ShiftForm) -> Result<Tensor> {
    z.binary(BinaryOp::Xor, &shift_right(z, amount, form)?)
}

/// Host `uniform()`: the top 53 bits as an f64 fraction in `[0, 1)` (exact).
fn uniform01(z: &Tensor, shifts: &Shifts) -> Result<Tensor> {
    shift_right(z, &shifts.by11, shifts.form)?.to_dtype(DType::F64)?.mul_scalar(1.0 / (1u64 << 53) as f64)
}

/// Each element's row-major index, as `Σ iota_d · stride_d`: elementwise in
/// every axis, so a split of the result splits this with it.
fn linear_index(shape: &Shape) -> Result<Tensor> {
    if shape.rank() == 0 {
        return u64_full(0, shape);
    }
    let strides = shape.strides();
    let mut index: Option<Tensor> = None;
    for (axis, &stride) in strides.iter().enumerate() {
        if shape.dims()[axis] == 1 {
            continue;
        }
        let term = Tensor::iota(DType::U64, shape.clone(), axis)?;
        let term = if stride == 1 { term } else { term.mul(&u64_full(stride as u64, shape)?)? };
        index = Some(match index {
            Some(i) => i.add(&term)?,
            None => term,
        });
    }
    match index {
        Some(i) => Ok(i),
        None => u64_full(0, shape),
    }
}

/// `value` broadcast to `shape` as an f32 value of its own: not the step's
/// shared broadcast constant (`Tensor::full` records one per value, dtype
/// and shape), which would make every parameter of that value one output
/// whose buffer they all hold. A shared buffer cannot be donated, so the
/// first training step would compile without those parameters' aliases,
/// unlike a host-initialised run's. XLA returns a buffer per output, also
/// where kiln's passes merge the values.
pub(crate) fn own_full(value: f32, shape: &Shape) -> Result<Tensor> {
    let literal = Literal::from_bytes(TensorType::scalar(DType::F32), value.to_le_bytes().to_vec())?;
    let c = context::with(|c| c.push(Op::Constant { literal })).map(Tensor::wrap)?;
    if shape.rank() == 0 {
        Ok(c)
    } else {
        c.broadcast_to(shape.clone())
    }
}

fn u64_literal(v: u64) -> Literal {
    Literal::from_bytes(TensorType::new(DType::U64, Shape::scalar()), v.to_le_bytes().to_vec())
        .expect("8 bytes fill a u64 scalar")
}

/// `v` broadcast to `shape`, as an exact `u64` constant (scalar constants
/// recorded through `Tensor::full` pass through an f64, which cannot hold
/// SplitMix64's 64-bit multipliers).
fn u64_full(v: u64, shape: &Shape) -> Result<Tensor> {
    let c = context::with(|c| c.push(Op::Constant { literal: u64_literal(v) })).map(Tensor::wrap)?;
    if shape.rank() == 0 {
        Ok(c)
    } else {
        c.broadcast_to(shape.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::nn::HostRng;

    #[test]
    fn draws_per_element_match_the_host_transforms() {
        assert_eq!(Init::Uniform { bound: 1.0 }.draws_per_element(), 1);
        assert_eq!(Init::Normal { std: 1.0 }.draws_per_element(), 2);
        assert_eq!(Init::Constant { value: 0.0 }.draws_per_element(), 0);
    }

    #[test]
    fn splitmix_is_counter_based_as_the_program_assumes() {
        // Draw k of seed s is mix(s + (k + 1)·γ): the identity `draws` rests on.
        let seed = 0x1234_5678_9abc_def0u64;
        let mut rng = HostRng::new(seed);
        for k in 0..100u64 {
            let mut at_k = HostRng::new(seed.wrapping_add(k.wrapping_mul(GAMMA)));
            assert_eq!(rng.next_u64(), at_k.next_u64(), "draw {k}");
        }
    }

    #[test]
    fn placement_parses_its_two_names_only() {
        assert_eq!(InitPlacement::parse("host"), Some(InitPlacement::Host));
        assert_eq!(InitPlacement::parse("device"), Some(InitPlacement::Device));
        assert_eq!(InitPlacement::parse("gpu"), None);
    }
}
