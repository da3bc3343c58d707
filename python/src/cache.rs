//! carve's per-user cache folder, for files that other tools load: the PTX (`carve.ptx_path()`).
//! `CARVE_CACHE_DIR`, else `$XDG_CACHE_HOME/carve`, else
//! `$HOME/.cache/carve`. It is created `0700` and used only while it is a directory that this
//! user owns and no one else can write: in a folder others can write, another user could plant
//! or swap a file between carve's check and its reader's load.

use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The cache folder, created if missing, after checking that it is private to this user.
pub fn dir() -> io::Result<PathBuf> {
    let dir = match env_path("CARVE_CACHE_DIR") {
        Some(d) => d,
        None => env_path("XDG_CACHE_HOME")
            .filter(|p| p.is_absolute())
            .or_else(|| env_path("HOME").map(|h| h.join(".cache")))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    "carve's cache: set CARVE_CACHE_DIR, XDG_CACHE_HOME or HOME",
                )
            })?
            .join("carve"),
    };
    if fs::symlink_metadata(&dir).is_err() {
        if let Some(parent) = dir.parent() {
            fs::create_dir_all(parent)?;
        }
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    let dir = dir.canonicalize()?;
    check_private(&dir, true)?;
    Ok(dir)
}

/// Refuses `path` unless it is a directory (or a regular file) that this user owns and that
/// neither its group nor others can write. Symbolic links are refused, not followed.
fn check_private(path: &Path, is_dir: bool) -> io::Result<()> {
    let refused = |why: String| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("carve's cache: {} {why}; it is not used", path.display()),
        )
    };
    let m = fs::symlink_metadata(path)?;
    if is_dir && !m.is_dir() {
        return Err(refused("is not a directory".into()));
    }
    if !is_dir && !m.file_type().is_file() {
        return Err(refused("is not a regular file".into()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(refused(format!(
            "is owned by user {}, not by this user ({me})",
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(refused(format!(
            "is writable by others (mode {:o})",
            m.mode() & 0o777
        )));
    }
    Ok(())
}

/// `dir/name` holding exactly `content`: the existing file if it is private and equal, else
/// written anew under an unpredictable temporary name and renamed into place (atomically, and
/// replacing whatever was there rather than writing through it).
pub fn write(dir: &Path, name: &str, content: &[u8]) -> io::Result<PathBuf> {
    let path = dir.join(name);
    if check_private(&path, false).is_ok() && fs::read(&path).ok().as_deref() == Some(content) {
        return Ok(path);
    }
    let (tmp, mut f) = create_unique(dir, name)?;
    let written = f.write_all(content).and_then(|()| f.sync_all());
    drop(f);
    if let Err(e) = written.and_then(|()| fs::rename(&tmp, &path)) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(path)
}

/// A new file `dir/.name.<random>.tmp`, mode `0600`, that did not exist before (`O_EXCL`).
fn create_unique(dir: &Path, name: &str) -> io::Result<(PathBuf, File)> {
    for _ in 0..16 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        let tmp = dir.join(format!(".{name}.{:016x}.tmp", h.finish()));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("carve's cache: no free temporary name in {}", dir.display()),
    ))
}
