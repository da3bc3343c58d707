//! The committed PTX (`src/driver/ptx/`, `lab/ptx/`), for builds that cannot compile `kernels/`:
//! its header, and the hash that ties it to the sources it was made from.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// What goes into the hash besides `kernels/src/`: the manifest and the build recipe.
const RECIPE: [&str; 3] = [
    "kernels/Cargo.toml",
    "build/compile.rs",
    "build/registers.rs",
];
const SOURCES_LINE: &str = "// sources: sha256 ";

/// The sha256 of the kernel sources, when this build has them.
pub struct Sources {
    pub hash: String,
}

impl Sources {
    /// `None` in a packaged crate, which has no `kernels/src/`.
    pub fn read(root: &Path) -> Option<Sources> {
        let src = root.join("kernels/src");
        if !src.is_dir() {
            return None;
        }
        let mut files: Vec<PathBuf> = RECIPE.iter().map(|f| root.join(f)).collect();
        collect(&src, &mut files);
        files.sort();
        let mut hash = Sha256::new();
        for file in &files {
            let rel = file.strip_prefix(root).unwrap_or(file);
            let text = fs::read_to_string(file)
                .unwrap_or_else(|e| crate::fail(&format!("reading {}: {e}", file.display())));
            // Paths with `/` and text with `\n`, so a Windows checkout hashes the same.
            hash.update(rel.to_string_lossy().replace('\\', "/").as_bytes());
            hash.update([0]);
            hash.update(text.replace("\r\n", "\n").as_bytes());
            hash.update([0]);
        }
        let hash = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Some(Sources { hash })
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir)
        .unwrap_or_else(|e| crate::fail(&format!("reading {}: {e}", dir.display())));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Where the committed copy of module `file` lives: in `dir`, relative to the workspace root.
pub fn path(root: &Path, dir: &str, file: &str) -> PathBuf {
    root.join(dir).join(file)
}

/// `body` with the header that records its toolchain and sources, and how to regenerate it.
pub fn with_header(
    file: &str,
    toolchain: &str,
    sources: &Sources,
    regenerate: &str,
    body: &str,
) -> String {
    format!(
        "// carve PTX module `{file}`, generated from kernels/: do not edit.\n\
         // toolchain: {toolchain}\n\
         {SOURCES_LINE}{}\n\
         // regenerate: {regenerate}\n\
         {body}",
        sources.hash
    )
}

/// The committed module `file` in `dir`, refused if it was made from other sources than
/// `sources`; `regenerate` is the command that rewrites it.
pub fn load(
    root: &Path,
    dir: &str,
    file: &str,
    regenerate: &str,
    sources: Option<&Sources>,
) -> Result<String, String> {
    let path = path(root, dir, file);
    let text = fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let Some(sources) = sources else {
        return Ok(text);
    };
    let recorded = text
        .lines()
        .take(8)
        .find_map(|l| l.strip_prefix(SOURCES_LINE))
        .unwrap_or("none");
    if recorded != sources.hash {
        let pinned = crate::toolchain::Toolchain::pinned(root);
        return Err(format!(
            "{} was generated from other kernels/ sources (sha256 {recorded}; the sources now \
             hash to {}), and this build did not compile kernels/ itself. Install the pinned \
             toolchain ({}) and build again, or regenerate the file with `{regenerate}`.",
            path.display(),
            sources.hash,
            pinned.install_hint()
        ));
    }
    Ok(text)
}
