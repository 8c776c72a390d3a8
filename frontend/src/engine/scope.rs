//! Layer scopes: which layer recorded which nodes of the trace.
//!
//! A layer's `forward` holds a [`LayerScope`] guard while it records; the guard
//! notes the span of node indices recorded under it, in the trace it was
//! entered in. `layer_of` answers which layer recorded a node (the innermost
//! enclosing span), `current` which layer is recording now. Anomaly mode
//! (`crate::engine::device_checks`) names the layer of the first non-finite op with it;
//! device-side range checks name the layer that recorded the checked op.
//!
//! Invariants:
//! - Spans are kept only for the trace that is being recorded (by epoch); a
//!   span of an older trace is never matched against a node of a newer one.
//! - Scopes nest: a span entered later and still open, or closed inside another
//!   span, lies inside it, so the innermost span of a node is the one that
//!   started last among those that contain it.
//! - Recording a span costs two borrows of the context per layer call and
//!   adds no node: the trace, its key and its program are the same with or
//!   without scopes.

use std::cell::RefCell;
use std::rc::Rc;

use crate::core::tensor::Tensor;
use crate::engine::context;

/// One layer call: nodes `start..end` of the trace with `epoch` were recorded
/// inside it (`end` is `None` while the layer is still recording).
struct Span {
    epoch: u64,
    start: usize,
    end: Option<usize>,
    name: Rc<str>,
}

thread_local! {
    static SPANS: RefCell<Vec<Span>> = const { RefCell::new(Vec::new()) };
}

/// While alive, nodes recorded on this thread belong to the layer it names.
#[must_use = "the scope ends when the guard is dropped"]
pub struct LayerScope {
    /// Index of this scope's span, `None` when the scope has no name.
    span: Option<usize>,
}

/// Enters the layer `name` until the guard is dropped.
pub fn enter(name: &str) -> LayerScope {
    let (epoch, start) = context::with(|c| (c.trace.epoch, c.trace.graph.len()));
    let span = SPANS.with(|s| {
        let mut s = s.borrow_mut();
        // Spans of finished traces are dropped when the next trace's first
        // layer starts, so the list holds one trace's layer calls.
        if s.first().is_some_and(|sp| sp.epoch != epoch) {
            s.retain(|sp| sp.epoch == epoch);
        }
        s.push(Span { epoch, start, end: None, name: Rc::from(name) });
        s.len() - 1
    });
    LayerScope { span: Some(span) }
}

/// Enters the layer that owns the parameter `param`, named after it without
/// its last `strip` dot-separated components (`"h0.attn.qkv.weight"` with 1 is
/// `"h0.attn.qkv"`). A parameter without a name enters no scope.
pub fn enter_owner_of(param: &Tensor, strip: usize) -> LayerScope {
    match param.name() {
        Some(name) => enter(&owner_name(&name, strip)),
        None => LayerScope { span: None },
    }
}

/// `name` without its last `strip` dot-separated components (the whole name
/// when it has too few).
fn owner_name(name: &str, strip: usize) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() <= strip {
        return name.to_string();
    }
    parts[..parts.len() - strip].join(".")
}

impl Drop for LayerScope {
    fn drop(&mut self) {
        let Some(i) = self.span else { return };
        // A trace swapped out while the scope was open (`lower`) is not the
        // trace the span started in; its end is then the span's start.
        let (epoch, len) = context::with(|c| (c.trace.epoch, c.trace.graph.len()));
        SPANS.with(|s| {
            if let Some(sp) = s.borrow_mut().get_mut(i) {
                sp.end = Some(if sp.epoch == epoch { len } else { sp.start });
            }
        });
    }
}

/// The layer that recorded node `index` of the trace with `epoch`, if any.
pub(crate) fn layer_of(epoch: u64, index: usize) -> Option<Rc<str>> {
    SPANS.with(|s| {
        s.borrow()
            .iter()
            .rfind(|sp| sp.epoch == epoch && sp.start <= index && sp.end.is_none_or(|e| index < e))
            .map(|sp| sp.name.clone())
    })
}

/// The layer recording now (the innermost open scope of the current trace).
pub(crate) fn current() -> Option<Rc<str>> {
    let epoch = context::with(|c| c.trace.epoch);
    SPANS.with(|s| s.borrow().iter().rev().find(|sp| sp.epoch == epoch && sp.end.is_none()).map(|sp| sp.name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_names_drop_the_last_components() {
        assert_eq!(owner_name("fc0.weight", 1), "fc0");
        assert_eq!(owner_name("h0.attn.qkv.weight", 2), "h0.attn");
        assert_eq!(owner_name("w", 1), "w");
    }

    #[test]
    fn nodes_belong_to_the_innermost_layer_that_recorded_them() -> crate::core::error::Result<()> {
        let x = Tensor::from_vec(vec![1f32, 2.0], [2])?;
        let before = x.tanh()?;
        let (inner_node, outer_node) = {
            let _outer = enter("block");
            let a = x.exp()?;
            let inner = {
                let _inner = enter("block.fc");
                assert_eq!(current().as_deref(), Some("block.fc"));
                x.neg()?
            };
            assert_eq!(current().as_deref(), Some("block"));
            let b = a.add(&inner)?;
            (node(&inner), node(&b))
        };
        let after = x.sin()?;
        let epoch = context::with(|c| c.trace.epoch);
        assert_eq!(layer_of(epoch, inner_node).as_deref(), Some("block.fc"));
        assert_eq!(layer_of(epoch, outer_node).as_deref(), Some("block"));
        assert_eq!(layer_of(epoch, node(&before)), None);
        assert_eq!(layer_of(epoch, node(&after)), None);
        assert_eq!(current(), None);
        drop((before, after));
        crate::engine::step::mark_step()?;
        Ok(())
    }

    fn node(t: &Tensor) -> usize {
        match &*t.inner.state.borrow() {
            crate::core::storage::State::Pending { value, .. } => value.node.index(),
            crate::core::storage::State::Ready(_) => panic!("pending in this test"),
        }
    }
}
