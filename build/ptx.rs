//! The build-script logic both crates share: put PTX modules compiled from `kernels/` (or their
//! committed copies) in `$OUT_DIR`. `build.rs` (the library's `carve.ptx`) and `lab/build.rs`
//! (the test and benchmark kernels, `carve_test.ptx`) each name their modules and call [`run`].
//!
//! | variable | effect |
//! |---|---|
//! | `CARVE_BUILD_KERNELS=0` | embed the committed files (no nightly needed) |
//! | `CARVE_BUILD_KERNELS=1` | compile from source, or fail |
//! | unset | compile when a toolchain can, else embed the committed files |
//! | `CARVE_KERNELS_TOOLCHAIN=T` | compile with rustup toolchain `T` instead of the pin |
//! | `CARVE_UPDATE_PTX=1` | compile with the pinned toolchain and rewrite the committed files |
//! | `CARVE_CHECK_PTX=1` | compile with the pinned toolchain and fail if a committed file differs |

use std::env;
use std::fs;
use std::path::Path;

use crate::committed::{self, Sources};
use crate::compile;
use crate::registers;
use crate::toolchain::Toolchain;

/// One PTX module a crate embeds.
pub struct Module {
    /// File name, in `$OUT_DIR` and in `committed_dir`.
    pub file: &'static str,
    /// `carve-kernels` features it is built with.
    pub features: &'static [&'static str],
    /// Where its committed copy lives, relative to the workspace root.
    pub committed_dir: &'static str,
    /// The command that rewrites the committed copy, for its header and error messages.
    pub regenerate: &'static str,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Committed,
    Source,
}

/// Writes every module of `modules` to `out_dir`; `root` is the workspace root.
pub fn run(root: &Path, out_dir: &Path, modules: &[Module]) {
    for var in [
        "CARVE_BUILD_KERNELS",
        "CARVE_KERNELS_TOOLCHAIN",
        "CARVE_UPDATE_PTX",
        "CARVE_CHECK_PTX",
        "DOCS_RS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let watched = [
        "kernels/src",
        "kernels/Cargo.toml",
        "build",
        "src/driver/ptx/TOOLCHAIN",
    ];
    let committed_dirs = modules.iter().map(|m| m.committed_dir);
    for path in watched.into_iter().chain(committed_dirs) {
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
    let sources = Sources::read(root);
    let Some(sources) = sources.filter(|_| env::var_os("DOCS_RS").is_none()) else {
        if update || check || mode == Mode::Source {
            fail("kernels/ sources are not part of this build; cannot compile or check the PTX");
        }
        return embed_committed(root, out_dir, modules, None);
    };

    if update || check {
        let pinned = Toolchain::pinned(root);
        if !pinned.usable() {
            fail(&format!(
                "CARVE_UPDATE_PTX / CARVE_CHECK_PTX need the pinned toolchain with rust-src: {}",
                pinned.install_hint()
            ));
        }
        let built = build_all(root, out_dir, modules, &pinned, &sources)
            .unwrap_or_else(|e| fail(&format!("building kernels/ with {}: {e}", pinned.name)));
        for (module, text) in modules.iter().zip(&built) {
            let path = committed::path(root, module.committed_dir, module.file);
            if update {
                write(&path, text);
            } else if fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                fail(&format!(
                    "{} is out of date with kernels/ under {}. Regenerate it with \
                     `{}` and commit the result.",
                    path.display(),
                    pinned.name,
                    module.regenerate
                ));
            }
        }
        return write_out(out_dir, modules, &built);
    }

    if mode == Mode::Committed {
        return embed_committed(root, out_dir, modules, Some(&sources));
    }
    let Some(toolchain) = Toolchain::pick(root) else {
        if mode == Mode::Source {
            fail(&format!(
                "CARVE_BUILD_KERNELS=1, but no Rust toolchain with rust-src can compile kernels/. \
                 Fix: {}",
                Toolchain::pinned(root).install_hint()
            ));
        }
        return embed_committed(root, out_dir, modules, Some(&sources));
    };
    match build_all(root, out_dir, modules, &toolchain, &sources) {
        Ok(built) => write_out(out_dir, modules, &built),
        Err(e) if mode == Mode::Auto => {
            println!(
                "cargo:warning=carve: building kernels/ with {} failed ({e}); embedding the \
                 committed PTX instead",
                toolchain.name
            );
            embed_committed(root, out_dir, modules, Some(&sources));
        }
        Err(e) => fail(&format!("building kernels/ with {}: {e}", toolchain.name)),
    }
}

/// Compiles every module of `modules` and returns their texts, each with its header.
fn build_all(
    root: &Path,
    out_dir: &Path,
    modules: &[Module],
    toolchain: &Toolchain,
    sources: &Sources,
) -> Result<Vec<String>, String> {
    modules
        .iter()
        .map(|m| {
            let body = compile::ptx(root, out_dir, toolchain, m.features)?;
            let body = registers::cap_heap_kernels(&body);
            Ok(committed::with_header(
                m.file,
                &toolchain.describe(),
                sources,
                m.regenerate,
                &body,
            ))
        })
        .collect()
}

/// Copies the committed modules to `out_dir`, after checking them against `sources` if given.
fn embed_committed(root: &Path, out_dir: &Path, modules: &[Module], sources: Option<&Sources>) {
    let texts: Vec<String> = modules
        .iter()
        .map(|m| {
            committed::load(root, m.committed_dir, m.file, m.regenerate, sources)
                .unwrap_or_else(|e| fail(&e))
        })
        .collect();
    write_out(out_dir, modules, &texts);
}

fn write_out(out_dir: &Path, modules: &[Module], texts: &[String]) {
    for (m, text) in modules.iter().zip(texts) {
        write(&out_dir.join(m.file), text);
    }
}

fn write(path: &Path, text: &str) {
    fs::write(path, text).unwrap_or_else(|e| fail(&format!("writing {}: {e}", path.display())));
}

fn flag(var: &str) -> bool {
    env::var_os(var).is_some_and(|v| v == "1")
}

/// Prints `msg` as cargo shows a build script's error, and stops the build.
pub fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}
