//! `carve replay`: replays an RMM allocation log (or one from
//! [`LoggingResourceAdaptor`](carve::adaptor::LoggingResourceAdaptor)) on any resource.
//!
//! Beyond RMM's replay benchmark: one thread per logged thread, run in the logged global order
//! (a sequencer); each logged stream mapped to a real stream; a report of peak usage, time,
//! failed allocations and the first failure with the usage and fragmentation at that moment;
//! and `--simulate-capacity`, which replays over address-only memory of a given size, with no GPU.
//!
//! | step | module |
//! |---|---|
//! | CSV -> events, with line numbers | [`parse`] |
//! | PyTorch snapshot -> events (`--format torch`) | [`torch`] |
//! | events -> checked plan (slots, threads, streams) | [`plan`](mod@plan) |
//! | `--resource` and its options | [`options`] |
//! | the options -> the resource and its streams | [`target`] |
//! | the threaded replay and its report | [`run`], [`report`] |
//! | bytes over time for `--plot` | [`timeline`] |
//! | the command line | [`cli`] |

pub mod cli;
mod observe;
pub mod options;
pub mod parse;
pub mod plan;
pub mod plot;
pub mod report;
pub mod run;
pub(crate) mod sequencer;
pub mod target;
mod timed;
pub mod timeline;
pub mod torch;

pub use options::{LargeUpstream, ResourceKind, ResourceOptions};
pub use parse::{parse_log, read_log, LogEvent};
pub use plan::{plan, Op, Plan, Step};
pub use report::{FirstFailure, ReplayReport};
pub use run::{replay, replay_passes, replay_sampled};
pub use target::{build_target, NoteProbe, SizeProbe, Target};
