//! Small helpers that append backward ops to the graph and remember which
//! forward values they read.
//!
//! Invariant: every op appended through [`Builder::op`] (all helpers go
//! through it) has each operand that is a forward value recorded as a
//! [`BackwardRead`], whether or not the rule marked it with [`Builder::fwd`].

use kiln_compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId,
};

use crate::core::error::Result;
use crate::core::trace::BackwardRead;

pub(crate) struct Builder<'g> {
    pub g: &'g mut Graph,
    pub saved: Vec<ValueId>,
    /// Every read of a forward value by a backward node, in creation order.
    pub reads: Vec<BackwardRead>,
    /// Nodes that existed before the backward pass: reading one is a save.
    forward_len: usize,
}

impl<'g> Builder<'g> {
    pub fn new(g: &'g mut Graph) -> Builder<'g> {
        let forward_len = g.len();
        Builder { g, saved: Vec::new(), reads: Vec::new(), forward_len }
    }

    /// Marks a forward value as read by the backward pass (documentation in
    /// the rules: [`Builder::op`] records the read when an op takes it).
    pub fn fwd(&mut self, v: ValueId) -> ValueId {
        v
    }

    pub fn ty(&self, v: ValueId) -> TensorType {
        self.g.ty(v).clone()
    }

    pub fn op(&mut self, op: Op) -> Result<ValueId> {
        let inputs = op.inputs();
        let v = self.g.value(op)?;
        for u in inputs {
            if u.node.index() < self.forward_len {
                self.reads.push(BackwardRead { forward: u, user: v.node });
                if !self.saved.contains(&u) {
                    self.saved.push(u);
                }
            }
        }
        Ok(v)
    }

    pub fn constant(&mut self, lit: Literal) -> Result<ValueId> {
        self.op(Op::Constant { literal: lit })
    }

    /// A scalar `value` of `dtype` broadcast to `shape`.
    pub fn full(&mut self, value: f64, dtype: DType, shape: &Shape) -> Result<ValueId> {
        let c = self.constant(Literal::scalar(dtype, value))?;
        if shape.rank() == 0 {
            return Ok(c);
        }
        self.op(Op::BroadcastInDim { input: c, shape: shape.clone(), dims: vec![] })
    }

    pub fn zeros(&mut self, ty: &TensorType) -> Result<ValueId> {
        self.full(0.0, ty.dtype, &ty.shape)
    }

    /// `value` shaped like `like`.
    pub fn full_like(&mut self, value: f64, like: ValueId) -> Result<ValueId> {
        let t = self.ty(like);
        self.full(value, t.dtype, &t.shape)
    }

    pub fn unary(&mut self, op: UnaryOp, input: ValueId) -> Result<ValueId> {
        self.op(Op::Unary { op, input })
    }

    pub fn binary(&mut self, op: BinaryOp, lhs: ValueId, rhs: ValueId) -> Result<ValueId> {
        self.op(Op::Binary { op, lhs, rhs })
    }

    pub fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Add, a, b)
    }

    pub fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Sub, a, b)
    }

    pub fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Mul, a, b)
    }

    pub fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Div, a, b)
    }

    pub fn neg(&mut self, a: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Neg, a)
    }

    pub fn scale(&mut self, a: ValueId, k: f64) -> Result<ValueId> {
        let c = self.full_like(k, a)?;
        self.mul(a, c)
    }

    pub fn compare(&mut self, dir: CompareDir, lhs: ValueId, rhs: ValueId) -> Result<ValueId> {
        self.op(Op::Compare { dir, lhs, rhs })
    }

    pub fn select(&mut self, pred: ValueId, on_true: ValueId, on_false: ValueId) -> Result<ValueId> {
        self.op(Op::Select { pred, on_true, on_false })
    }

    pub fn sum(&mut self, input: ValueId, axes: Vec<usize>) -> Result<ValueId> {
        if axes.is_empty() {
            return Ok(input);
        }
        self.op(Op::Reduce { op: ReduceOp::Sum, input, axes })
    }

    pub fn reshape(&mut self, input: ValueId, shape: Shape) -> Result<ValueId> {
        if self.g.ty(input).shape == shape {
            return Ok(input);
        }
        self.op(Op::Reshape { input, shape })
    }

    pub fn broadcast(&mut self, input: ValueId, shape: Shape, dims: Vec<usize>) -> Result<ValueId> {
        if self.g.ty(input).shape == shape {
            return Ok(input);
        }
        self.op(Op::BroadcastInDim { input, shape, dims })
    }

    pub fn transpose(&mut self, input: ValueId, perm: Vec<usize>) -> Result<ValueId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(input);
        }
        self.op(Op::Transpose { input, perm })
    }

    pub fn dot(&mut self, lhs: ValueId, rhs: ValueId, dims: DotDims) -> Result<ValueId> {
        self.op(Op::DotGeneral { lhs, rhs, dims })
    }
}
