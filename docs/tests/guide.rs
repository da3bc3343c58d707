//! Every ```rust example of the guide (`docs/guide/*.md`), one test each, named after its chapter
//! and its place in it. `build.rs` extracts them; examples that need a GPU skip without one
//! (`SKIPPED ...`), and fail under `CARVE_REQUIRE_GPU=1`.

include!(concat!(env!("OUT_DIR"), "/guide_examples.rs"));
