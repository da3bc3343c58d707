//! Puts carve's two PTX modules in `$OUT_DIR`: `carve.ptx`, the shipped device-heap ABI, and
//! `carve_test.ptx`, the kernels only carve's tests and benchmarks load.
//!
//! They come either from `kernels/` compiled here (rustc's nvptx backend; no CUDA toolkit), or
//! from the files committed in `src/driver/ptx/`, which record the toolchain that made them and a
//! hash of the sources. A committed file whose hash no longer matches the sources is refused:
//! carve never embeds a stale PTX.
//!
//! | variable | effect |
//! |---|---|
//! | `CARVE_BUILD_KERNELS=0` | embed the committed files (no nightly needed) |
//! | `CARVE_BUILD_KERNELS=1` | compile from source, or fail |
//! | unset | compile when a toolchain can, else embed the committed files |
//! | `CARVE_KERNELS_TOOLCHAIN=T` | compile with rustup toolchain `T` instead of the pin |
//! | `CARVE_UPDATE_PTX=1` | compile with the pinned toolchain and rewrite `src/driver/ptx/` |
//! | `CARVE_CHECK_PTX=1` | compile with the pinned toolchain and fail if `src/driver/ptx/` differs |

#[path = "build/committed.rs"]
mod committed;
#[path = "build/compile.rs"]
mod compile;
#[path = "build/registers.rs"]
mod registers;
#[path = "build/toolchain.rs"]
mod toolchain;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use committed::Sources;
use toolchain::Toolchain;

/// The modules carve embeds: (file name, `carve-kernels` features).
pub const MODULES: [(&str, &[&str]); 2] =
    [("carve.ptx", &[]), ("carve_test.ptx", &["test-kernels"])];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Committed,
    Source,
}

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for var in [
        "CARVE_BUILD_KERNELS",
        "CARVE_KERNELS_TOOLCHAIN",
        "CARVE_UPDATE_PTX",
        "CARVE_CHECK_PTX",
        "DOCS_RS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for path in [
        "kernels/src",
        "kernels/Cargo.toml",
        "src/driver/ptx",
        "build",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }

    let mode = match env::var("CARVE_BUILD_KERNELS").as_deref() {
        Err(_) => Mode::Auto,
        Ok("0") => Mode::Committed,
        Ok("1") => Mode::Source,
        Ok(other) => fail(&format!("CARVE_BUILD_KERNELS={other}: expected 0 or 1")),
    };
    let update = flag("CARVE_UPDATE_PTX");
    let check = flag("CARVE_CHECK_PTX");
    // A published crate has no kernels/ sources (cargo packages each crate alone), and docs.rs
    // has no GPU toolchain to spare: both embed the committed files as they are.
    let sources = Sources::read(&root);
    let Some(sources) = sources.filter(|_| env::var_os("DOCS_RS").is_none()) else {
        if update || check || mode == Mode::Source {
            fail("kernels/ sources are not part of this build; cannot compile or check the PTX");
        }
        return embed_committed(&root, &out_dir, None);
    };

    if update || check {
        let pinned = Toolchain::pinned(&root);
        if !pinned.usable() {
            fail(&format!(
                "CARVE_UPDATE_PTX / CARVE_CHECK_PTX need the pinned toolchain with rust-src: {}",
                pinned.install_hint()
            ));
        }
        let built = build_all(&root, &out_dir, &pinned, &sources)
            .unwrap_or_else(|e| fail(&format!("building kernels/ with {}: {e}", pinned.name)));
        for ((file, _), text) in MODULES.iter().zip(&built) {
            let path = committed::path(&root, file);
            if update {
                write(&path, text);
            } else if fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                fail(&format!(
                    "{} is out of date with kernels/ under {}. Regenerate it with \
                     `CARVE_UPDATE_PTX=1 cargo build` and commit the result.",
                    path.display(),
                    pinned.name
                ));
            }
        }
        return write_out(&out_dir, &built);
    }

    if mode == Mode::Committed {
        return embed_committed(&root, &out_dir, Some(&sources));
    }
    let Some(toolchain) = Toolchain::pick(&root) else {
        if mode == Mode::Source {
            fail(&format!(
                "CARVE_BUILD_KERNELS=1, but no Rust toolchain with rust-src can compile kernels/. \
                 Fix: {}",
                Toolchain::pinned(&root).install_hint()
            ));
        }
        return embed_committed(&root, &out_dir, Some(&sources));
    };
    match build_all(&root, &out_dir, &toolchain, &sources) {
        Ok(built) => write_out(&out_dir, &built),
        Err(e) if mode == Mode::Auto => {
            println!(
                "cargo:warning=carve: building kernels/ with {} failed ({e}); embedding the \
                 committed PTX instead",
                toolchain.name
            );
            embed_committed(&root, &out_dir, Some(&sources));
        }
        Err(e) => fail(&format!("building kernels/ with {}: {e}", toolchain.name)),
    }
}

/// Compiles every module of [`MODULES`] and returns their texts, each with its header.
fn build_all(
    root: &Path,
    out_dir: &Path,
    toolchain: &Toolchain,
    sources: &Sources,
) -> Result<Vec<String>, String> {
    MODULES
        .iter()
        .map(|(file, features)| {
            let body = compile::ptx(root, out_dir, toolchain, features)?;
            let body = registers::cap_heap_kernels(&body);
            Ok(committed::with_header(
                file,
                &toolchain.describe(),
                sources,
                &body,
            ))
        })
        .collect()
}

/// Copies the committed modules to `out_dir`, after checking them against `sources` if given.
fn embed_committed(root: &Path, out_dir: &Path, sources: Option<&Sources>) {
    let texts: Vec<String> = MODULES
        .iter()
        .map(|(file, _)| committed::load(root, file, sources).unwrap_or_else(|e| fail(&e)))
        .collect();
    write_out(out_dir, &texts);
}

fn write_out(out_dir: &Path, texts: &[String]) {
    for ((file, _), text) in MODULES.iter().zip(texts) {
        write(&out_dir.join(file), text);
    }
}

fn write(path: &Path, text: &str) {
    fs::write(path, text).unwrap_or_else(|e| fail(&format!("writing {}: {e}", path.display())));
}

fn flag(var: &str) -> bool {
    env::var_os(var).is_some_and(|v| v == "1")
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}
