//! Emission of the attention composites as XLA's cuDNN flash-attention
//! calls (`cudnn.rs` has their names and configs), in the form
//! `composite::expand` prepared them: BNTH operands transposed to BTNH, one
//! bias or none, grouped heads; under a mesh, each call on one device's
//! shard inside a manual region.

use crate::ir::{AttentionAttrs, Node, NodeId, TensorType, ValueId};
use crate::CompileError;

use super::cudnn;
use super::emit::{join, manual_results, row_major, Emitter};

impl Emitter<'_> {
    /// `attention` of `[q, k, v]` at node `id`.
    pub(super) fn attention(
        &mut self,
        id: NodeId,
        node: &Node,
        [q, k, v]: [ValueId; 3],
        bias: &[ValueId],
        mask: Option<ValueId>,
        attrs: AttentionAttrs,
    ) -> Result<(), CompileError> {
        let (q, k, v, mask, attrs) = (&q, &k, &v, &mask, &attrs);
        cudnn::check_prepared(id, self.ty(*q), self.ty(*v), bias, *mask, *attrs)?;
        let (tq, s) = (self.ty(*q).clone(), self.ty(*k).shape.dims()[2]);
        let xs = self.transpose_to_btnh(id, &[("q", *q), ("k", *k), ("v", *v)]);
        let ins: Vec<TensorType> = [*q, *k, *v].iter().map(|&x| cudnn::btnh(self.ty(x))).collect();
        let bias = bias.first().copied();
        let split = if bias.is_some() { None } else { self.attention_split(&tq) };
        let (mut xs, mut ins, tq, outs) = match &split {
            None => (xs, ins, tq, node.outputs.to_vec()),
            Some(sp) => (
                self.enter_region(id, &["q", "k", "v"], &xs, &ins, sp),
                ins.iter().map(|t| sp.btnh_shard(t)).collect(),
                sp.bn_shard(&tq),
                vec![sp.bn_shard(&node.outputs[0]), sp.bn_shard(&node.outputs[1])],
            ),
        };
        if let Some(b) = bias {
            xs.push(self.name(b));
            ins.push(self.ty(b).clone());
        }
        let layouts = vec![row_major(4); ins.len()].join(", ");
        let call = Self::helper(id, "fmha");
        self.line(format!(
            "{call}:3 = stablehlo.custom_call @{}({}) {{api_version = 2 : i32, backend_config = \"{}\", {}\
                 operand_layouts = [{layouts}], result_layouts = [{}, {}, {}]}} : ({}) -> ({}, {}, {})",
            cudnn::forward_target(bias.is_some()),
            xs.join(", "),
            cudnn::backend_config(&tq, s, *attrs, false),
            manual_results(split.is_some(), 3),
            cudnn::BNTH_AS_BTNH,
            row_major(3),
            row_major(1),
            join(ins),
            outs[0],
            outs[1],
            cudnn::WORKSPACE,
        ));
        let results: Vec<String> = (0..2).map(|i| format!("{call}#{i}")).collect();
        self.names[id.index()] = match &split {
            None => results,
            Some(sp) => {
                let specs = [sp.bnth.as_str(), sp.bnt.as_str()];
                self.leave_region(id, &["out", "stats"], &results, &outs, &node.outputs, &specs)
            }
        };
        Ok(())
    }

    /// `attention_grad` of `[q, k, v]` with the forward's `[out, stats]` and
    /// the cotangent `dout`, at node `id`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_grad(
        &mut self,
        id: NodeId,
        node: &Node,
        [q, k, v]: [ValueId; 3],
        bias: &[ValueId],
        mask: Option<ValueId>,
        [out, stats, dout]: [ValueId; 3],
        attrs: AttentionAttrs,
    ) -> Result<(), CompileError> {
        let (q, k, v, mask, out, stats, dout, attrs) = (&q, &k, &v, &mask, &out, &stats, &dout, &attrs);
        cudnn::check_prepared(id, self.ty(*q), self.ty(*v), bias, *mask, *attrs)?;
        let (tq, s) = (self.ty(*q).clone(), self.ty(*k).shape.dims()[2]);
        let bias = bias.first().copied();
        let mut xs = self.transpose_to_btnh(id, &[("q", *q), ("k", *k), ("v", *v)]);
        let go = self.transpose_to_btnh(id, &[("dout", *dout), ("out", *out)]);
        xs.push(self.name(*stats));
        xs.extend(go);
        let bt = |e: &Self, x: ValueId| cudnn::btnh(e.ty(x));
        let ins =
            vec![bt(self, *q), bt(self, *k), bt(self, *v), self.ty(*stats).clone(), bt(self, *dout), bt(self, *out)];
        let split = if bias.is_some() { None } else { self.attention_split(&tq) };
        let (mut xs, mut ins, tq, mut outs) = match &split {
            None => (xs, ins, tq, node.outputs[..3].to_vec()),
            Some(sp) => {
                let mut local = self.enter_region(id, &["q", "k", "v"], &xs[..3], &ins[..3], sp);
                local.push(self.enter_region_as(id, "stats", &xs[3], &ins[3], &sp.bnt, sp.bn_shard(&ins[3])));
                local.extend(self.enter_region(id, &["dout", "out"], &xs[4..], &ins[4..], sp));
                let mut lins: Vec<TensorType> = ins.iter().map(|t| sp.btnh_shard(t)).collect();
                lins[3] = sp.bn_shard(&ins[3]);
                (local, lins, sp.bn_shard(&tq), node.outputs.iter().map(|t| sp.bn_shard(t)).collect())
            }
        };
        // cuDNN's operand order: q, k, v, stats, dout, bias, out.
        let dbias = bias.filter(|&b| cudnn::exports_dbias(self.ty(b), &tq));
        if let Some(b) = bias {
            xs.insert(5, self.name(b));
            ins.insert(5, self.ty(b).clone());
        }
        let mut result_layouts = vec![cudnn::BNTH_AS_BTNH.to_string(); 3];
        if let Some(b) = dbias {
            outs.push(self.ty(b).clone());
            result_layouts.push(row_major(4));
        }
        result_layouts.push(row_major(1));
        let operand_layouts: Vec<String> =
            ins.iter().map(|t| if t.shape.rank() == 3 { row_major(3) } else { row_major(4) }).collect();
        let call = Self::helper(id, "fmha");
        let n_results = outs.len() + 1;
        self.line(format!(
            "{call}:{n_results} = stablehlo.custom_call @{}({}) {{api_version = 2 : i32, backend_config = \"{}\", {}\
                 operand_layouts = [{}], result_layouts = [{}]}} : ({}) -> ({}, {})",
            cudnn::backward_target(bias.is_some()),
            xs.join(", "),
            cudnn::backend_config(&tq, s, *attrs, true),
            manual_results(split.is_some(), n_results),
            operand_layouts.join(", "),
            result_layouts.join(", "),
            join(ins),
            join(outs.clone()),
            cudnn::WORKSPACE,
        ));
        let mut results: Vec<String> = (0..3).map(|i| format!("{call}#{i}")).collect();
        results = match &split {
            None => results,
            Some(sp) => {
                let specs = [sp.bnth.as_str(); 3];
                self.leave_region(id, &["dq", "dk", "dv"], &results, &outs, &node.outputs, &specs)
            }
        };
        if let Some(b) = bias {
            // The bias gradient, or zeros where cuDNN exports none
            // (`composite::fusable` makes sure nothing reads them).
            let bty = self.ty(b).clone();
            if dbias.is_some() {
                results.push(format!("{call}#3"));
            } else {
                let z = Self::helper(id, "no_dbias");
                self.line(format!("{z} = stablehlo.constant dense<0.0> : {bty}"));
                results.push(z);
            }
        }
        self.names[id.index()] = results;
        Ok(())
    }

    /// The split of an attention call on `q` (BNTH), if the module has one
    /// whose parts divide its batch and heads.
    fn attention_split(&self, q: &TensorType) -> Option<super::AttentionSplit> {
        let sp = self.attention.as_ref()?;
        let d = q.shape.dims();
        (d[0] % sp.batch == 0 && d[1] % sp.heads == 0).then(|| sp.clone())
    }

    /// `xs` (BTNH operands of types `ts`) as this device's shards, inside
    /// the manual region; returns their names.
    fn enter_region(
        &mut self,
        id: NodeId,
        roles: &[&str],
        xs: &[String],
        ts: &[TensorType],
        sp: &super::AttentionSplit,
    ) -> Vec<String> {
        roles
            .iter()
            .zip(xs)
            .zip(ts)
            .map(|((r, x), t)| self.enter_region_as(id, r, x, t, &sp.btnh, sp.btnh_shard(t)))
            .collect()
    }

    /// `x` (global type `t`, sharded as `spec`) as this device's shard of
    /// type `local`.
    fn enter_region_as(
        &mut self,
        id: NodeId,
        role: &str,
        x: &str,
        t: &TensorType,
        spec: &str,
        local: TensorType,
    ) -> String {
        let (a, b) = (Self::helper(id, &format!("{role}_sharded")), Self::helper(id, &format!("{role}_shard")));
        self.line(format!("{a} = stablehlo.custom_call @Sharding({x}) {{mhlo.sharding = \"{spec}\"}} : ({t}) -> {t}"));
        self.line(format!(
            "{b} = stablehlo.custom_call @SPMDFullToShardShape({a}) {{mhlo.sharding = \"{{manual}}\"}} : ({t}) -> {local}"
        ));
        b
    }

    /// The call's per-device `results` (types `locals`) as global values of
    /// types `globals`, sharded as `specs`; returns their names.
    fn leave_region(
        &mut self,
        id: NodeId,
        roles: &[&str],
        results: &[String],
        locals: &[TensorType],
        globals: &[TensorType],
        specs: &[&str],
    ) -> Vec<String> {
        let mut names = Vec::with_capacity(results.len());
        for (i, r) in results.iter().enumerate() {
            let (a, b) =
                (Self::helper(id, &format!("{}_manual", roles[i])), Self::helper(id, &format!("{}_full", roles[i])));
            let (l, g) = (&locals[i], &globals[i]);
            self.line(format!(
                "{a} = stablehlo.custom_call @Sharding({r}) {{mhlo.sharding = \"{{manual}}\"}} : ({l}) -> {l}"
            ));
            self.line(format!(
                "{b} = stablehlo.custom_call @SPMDShardToFullShape({a}) {{mhlo.sharding = \"{}\"}} : ({l}) -> {g}",
                specs[i]
            ));
            names.push(b);
        }
        names
    }

    /// Transposes BNTH operands to BTNH for the cuDNN calls; returns their names.
    fn transpose_to_btnh(&mut self, id: NodeId, xs: &[(&str, ValueId)]) -> Vec<String> {
        xs.iter()
            .map(|&(role, x)| {
                let (name, t) = (self.name(x), self.ty(x).clone());
                let h = Self::helper(id, role);
                self.line(format!(
                    "{h} = stablehlo.transpose {name}, dims = [0, 2, 1, 3] : ({t}) -> {}",
                    cudnn::btnh(&t)
                ));
                h
            })
            .collect()
    }
}
