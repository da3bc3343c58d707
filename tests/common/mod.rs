//! Helpers the integration tests share, one small module each. A test file takes them with
//! `mod common;` (from `lab/tests/`: `#[path = "../../tests/common/mod.rs"] mod common;`).
// Each test binary uses a part of them.
#![allow(dead_code, unused_imports)]

pub mod model;
pub mod rng;
pub mod shared_buf;
pub mod upstream;

pub use model::{run_ops, stream, Model, Op};
pub use rng::cases;
pub use shared_buf::SharedBuf;
pub use upstream::{Request, ScriptedUpstream};
