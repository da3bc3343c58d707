//! Which Rust toolchain compiles `kernels/`: the pin in `src/driver/ptx/TOOLCHAIN` when installed,
//! else any nightly (with a warning naming the pin), else stable under `RUSTC_BOOTSTRAP=1`.

use std::env;
use std::path::Path;
use std::process::Command;

/// A rustup toolchain, by name.
pub struct Toolchain {
    pub name: String,
    /// Unstable flags need `RUSTC_BOOTSTRAP=1` (a stable toolchain).
    pub bootstrap: bool,
}

impl Toolchain {
    /// The toolchain named in `src/driver/ptx/TOOLCHAIN`, the one that made the committed PTX.
    pub fn pinned(root: &Path) -> Toolchain {
        let path = root.join("src/driver/ptx/TOOLCHAIN");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| crate::fail(&format!("reading {}: {e}", path.display())));
        let name = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .unwrap_or_else(|| crate::fail(&format!("{} names no toolchain", path.display())));
        Toolchain {
            name: name.to_owned(),
            bootstrap: false,
        }
    }

    /// The toolchain to compile with, or `None` when none has rust-src.
    pub fn pick(root: &Path) -> Option<Toolchain> {
        if let Ok(name) = env::var("CARVE_KERNELS_TOOLCHAIN") {
            return Some(Toolchain {
                bootstrap: name.starts_with("stable") || name.starts_with("1."),
                name,
            });
        }
        let pinned = Toolchain::pinned(root);
        if pinned.usable() {
            return Some(pinned);
        }
        let nightly = Toolchain {
            name: "nightly".to_owned(),
            bootstrap: false,
        };
        if nightly.usable() {
            println!(
                "cargo:warning=carve: the pinned kernel toolchain {} is not installed; compiling \
                 kernels/ with `nightly`, whose PTX may differ from the committed one. Prefer: {}",
                pinned.name,
                pinned.install_hint()
            );
            return Some(nightly);
        }
        let stable = Toolchain {
            name: "stable".to_owned(),
            bootstrap: true,
        };
        if stable.usable() {
            println!(
                "cargo:warning=carve: no nightly with rust-src; compiling kernels/ with stable and \
                 RUSTC_BOOTSTRAP=1. Prefer: {}",
                pinned.install_hint()
            );
            return Some(stable);
        }
        None
    }

    /// Installed, with the rust-src component that `-Zbuild-std=core` needs.
    pub fn usable(&self) -> bool {
        let Some(sysroot) = self.rustc_output(&["--print", "sysroot"]) else {
            return false;
        };
        Path::new(sysroot.trim())
            .join("lib/rustlib/src/rust/library/core/Cargo.toml")
            .exists()
    }

    /// The command that installs this toolchain with rust-src.
    pub fn install_hint(&self) -> String {
        format!(
            "rustup toolchain install {} --profile minimal --component rust-src",
            self.name
        )
    }

    /// The name and `rustc --version`, for the PTX header.
    pub fn describe(&self) -> String {
        let version = self
            .rustc_output(&["--version"])
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| "version unknown".to_owned());
        let bootstrap = if self.bootstrap {
            ", RUSTC_BOOTSTRAP=1"
        } else {
            ""
        };
        format!("{} ({version}{bootstrap})", self.name)
    }

    /// `rustup run <name> <program>`, with the outer build's variables removed.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("rustup");
        cmd.args(["run", &self.name, program]);
        scrub(&mut cmd);
        if self.bootstrap {
            cmd.env("RUSTC_BOOTSTRAP", "1");
        }
        cmd
    }

    fn rustc_output(&self, args: &[&str]) -> Option<String> {
        let out = self.command("rustc").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Removes what the outer build sets for itself, so the inner build sees a plain environment.
fn scrub(cmd: &mut Command) {
    for (key, _) in env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let outer_cargo = key.starts_with("CARGO_") && key != "CARGO_HOME";
        let outer_rustc = matches!(
            key,
            "RUSTC"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTDOC"
                | "RUSTFLAGS"
                | "RUSTDOCFLAGS"
                | "RUSTUP_TOOLCHAIN"
                | "RUSTC_BOOTSTRAP"
                | "MAKEFLAGS"
                | "MFLAGS"
        );
        if outer_cargo || outer_rustc {
            cmd.env_remove(key);
        }
    }
}
