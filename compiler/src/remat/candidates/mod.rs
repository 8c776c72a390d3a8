//! More candidates and finishing rewrites for greedy's plans, built on the
//! mechanism of [`super::chain`]: whole stretches of the forward between two
//! cuts ([`blocks`]), siblings recomputed with a shared chain ([`siblings`]);
//! twin GEMMs merged after a plan ([`twins`]) and backward kernels pinned
//! behind a guard ([`pin`]).

pub(crate) mod blocks;
pub(crate) mod pin;
pub(crate) mod siblings;
pub(crate) mod twins;
