//! Gallatin (saltsystemslab/gallatin) beside carve's rows, from a checkout the user names with
//! `--gallatin DIR`: `lab/gallatin/harness.cu` (embedded in the binary, so that it runs where
//! the tree is not) is built once per run with nvcc into a private temporary directory, then
//! run once per row with that row's N, sizes and timing. Gallatin's files stay in the user's
//! checkout; only `DIR/include` is read.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::layout::Peer;

/// The harness source, compiled on the machine that runs the bench.
const HARNESS: &str = include_str!("../../../gallatin/harness.cu");
/// The header the harness includes, relative to the checkout.
const HEADER: &str = "include/gallatin/allocators/gallatin.cuh";
/// Gallatin's segment size in the harness (`Gallatin<16 MiB, 16, 4096>`).
pub(super) const SEGMENT: u64 = 16 << 20;
/// The largest slice in the harness's configuration: larger requests take whole blocks.
pub(super) const LARGEST_SLICE: u64 = 4096;
/// Room beyond the requests: every size tree takes whole segments, and its boot pins blocks.
const SLACK: u64 = 1 << 30;

/// What the harness needs before it can be built: nvcc and the checkout's include directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Found {
    pub nvcc: PathBuf,
    pub include: PathBuf,
}

/// Whether Gallatin can join this run: `Err` says why not, for a note under the table.
pub(super) fn find(dir: Option<&Path>) -> Result<Found, String> {
    let dir = dir.ok_or("no --gallatin DIR (a checkout of saltsystemslab/gallatin) was given")?;
    if !dir.join(HEADER).is_file() {
        return Err(format!(
            "--gallatin {}: no {HEADER} there (give a checkout of saltsystemslab/gallatin)",
            dir.display()
        ));
    }
    let nvcc = find_nvcc(
        std::env::var_os("CUDACXX"),
        std::env::var_os("PATH"),
        std::env::var_os("CUDA_HOME"),
    )?;
    Ok(Found {
        nvcc,
        include: dir.join("include"),
    })
}

/// nvcc: `$CUDACXX` when set (CMake's variable for the CUDA compiler), else the first on `PATH`,
/// `$CUDA_HOME/bin` or `/usr/local/cuda/bin`.
fn find_nvcc(
    cudacxx: Option<OsString>,
    path: Option<OsString>,
    cuda_home: Option<OsString>,
) -> Result<PathBuf, String> {
    if let Some(c) = cudacxx.filter(|c| !c.is_empty()) {
        let c = PathBuf::from(c);
        return if c.is_file() {
            Ok(c)
        } else {
            Err(format!(
                "nvcc not found: CUDACXX={} is not a file",
                c.display()
            ))
        };
    }
    let mut dirs: Vec<PathBuf> = path
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(cuda_home.map(|h| PathBuf::from(h).join("bin")));
    dirs.push(PathBuf::from("/usr/local/cuda/bin"));
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda/bin; or set CUDACXX)".into()
        })
}

/// nvcc's arguments: optimised, for the device's architecture, static CUDA runtime (nvcc's
/// default), one translation unit.
fn nvcc_args(include: &Path, src: &Path, exe: &Path, cc: (i32, i32)) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["-O3", "-std=c++17"].map(OsString::from).to_vec();
    args.push(format!("-arch=sm_{}{}", cc.0, cc.1).into());
    args.push("-I".into());
    args.push(include.into());
    args.push("-o".into());
    args.push(exe.into());
    args.push(src.into());
    args
}

/// A new temporary directory with a random name that only this user can enter (tempfile's own
/// mode follows the umask).
fn private_dir() -> std::io::Result<tempfile::TempDir> {
    let mut b = tempfile::Builder::new();
    b.prefix("carve-gallatin-");
    #[cfg(unix)]
    let owner_only = {
        use std::os::unix::fs::PermissionsExt;
        std::fs::Permissions::from_mode(0o700)
    };
    #[cfg(unix)]
    b.permissions(owner_only);
    b.tempdir()
}

/// The built harness, in a temporary directory removed when this is dropped.
#[derive(Debug)]
pub(super) struct Harness {
    exe: PathBuf,
    /// How the harness was built, for the table's note.
    pub built: String,
    _dir: tempfile::TempDir,
}

impl Found {
    /// Builds the harness for a device of compute capability `cc`, or says why it failed.
    pub fn build(&self, cc: (i32, i32)) -> Result<Harness, String> {
        let dir =
            private_dir().map_err(|e| format!("a temporary directory for the harness: {e}"))?;
        let src = dir.path().join("harness.cu");
        let exe = dir.path().join("harness");
        std::fs::write(&src, HARNESS).map_err(|e| format!("{}: {e}", src.display()))?;
        let args = nvcc_args(&self.include, &src, &exe, cc);
        let started = Instant::now();
        let out = Command::new(&self.nvcc)
            .args(&args)
            .output()
            .map_err(|e| format!("{}: {e}", self.nvcc.display()))?;
        if !out.status.success() {
            return Err(format!(
                "nvcc failed ({}): {}",
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 5)
            ));
        }
        let flags: Vec<_> = args[..5].iter().map(|a| a.to_string_lossy()).collect();
        Ok(Harness {
            built: format!(
                "built in {:.0} s with {}{} {}, Gallatin {}",
                started.elapsed().as_secs_f64(),
                self.nvcc.display(),
                version(&self.nvcc).map_or(String::new(), |v| format!(" ({v})")),
                flags.join(" "),
                commit(&self.include).unwrap_or_else(|| "(no git commit found)".into()),
            ),
            exe,
            _dir: dir,
        })
    }
}

/// nvcc's release line (`Cuda compilation tools, release 13.0, V13.0.88`), if it prints one.
fn version(nvcc: &Path) -> Option<String> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains("release"))
        .map(|l| l.trim().to_string())
}

/// The checkout's commit, if the directory above `include` is the top of a git work tree (a
/// checkout copied inside another repository is not that repository's commit).
fn commit(include: &Path) -> Option<String> {
    let dir = include.parent()?;
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["rev-parse", "--show-toplevel", "--short=12", "HEAD"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let (top, head) = (lines.next()?, lines.next()?);
    let same = std::fs::canonicalize(top).ok()? == std::fs::canonicalize(dir).ok()?;
    (out.status.success() && same).then(|| format!("at {head}"))
}

/// The last `lines` non-empty lines of `text`, joined with " / ".
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join(" / ")
}

/// What one row asks of each thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sizes {
    /// Every thread `bytes`.
    One(u64),
    /// Thread `i`: `bench_request_size(i, seed, max)`.
    Mixed { max: u64, seed: u32 },
}

/// One run of the harness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Request {
    pub n: u64,
    pub sizes: Sizes,
    pub heap_bytes: u64,
    pub runs: usize,
}

impl Request {
    /// The harness's command line.
    fn args(&self) -> Vec<String> {
        let mut a = vec!["--n".to_string(), self.n.to_string()];
        match self.sizes {
            Sizes::One(bytes) => a.extend(["--size".into(), bytes.to_string()]),
            Sizes::Mixed { max, seed } => a.extend([
                "--max".into(),
                max.to_string(),
                "--seed".into(),
                seed.to_string(),
            ]),
        }
        a.extend([
            "--heap-bytes".into(),
            self.heap_bytes.to_string(),
            "--runs".into(),
            self.runs.to_string(),
        ]);
        a
    }
}

/// Gallatin's medians for one row, and its null pointers over every allocation launch.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Measured {
    pub alloc_ms: f64,
    pub free_ms: f64,
    pub failed: u64,
}

/// The harness's `carve-gallatin key=value ...` line in `stdout`.
fn parse(stdout: &str) -> Result<Measured, String> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("carve-gallatin "))
        .ok_or("the harness printed no carve-gallatin line")?;
    let get = |key: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .ok_or(format!("no {key}= in the harness's line: {line}"))
    };
    let ms = |key: &str| {
        get(key)?
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or(format!("{key} is not a positive time: {line}"))
    };
    Ok(Measured {
        alloc_ms: ms("alloc_ms")?,
        free_ms: ms("free_ms")?,
        failed: get("failed")?
            .parse()
            .map_err(|e| format!("failed: {e}: {line}"))?,
    })
}

impl Harness {
    /// The rates of one row, or `None` with why in `notes` (as "Gallatin, `what`: ...").
    pub fn row(&self, req: &Request, what: &str, notes: &mut Vec<String>) -> Option<Peer> {
        match self.run(req) {
            Ok(m) => Some(Peer {
                alloc: req.n as f64 / (m.alloc_ms * 1e6),
                free: req.n as f64 / (m.free_ms * 1e6),
                failed: m.failed,
            }),
            Err(e) => {
                notes.push(format!("Gallatin, {what}: no figures: {e}"));
                None
            }
        }
    }

    /// Runs one row, or says why it gave no figures.
    fn run(&self, req: &Request) -> Result<Measured, String> {
        let out = Command::new(&self.exe)
            .args(req.args())
            .output()
            .map_err(|e| format!("{}: {e}", self.exe.display()))?;
        if !out.status.success() {
            return Err(format!(
                "the harness exited with {}: {}",
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 3)
            ));
        }
        parse(&String::from_utf8_lossy(&out.stdout))
    }
}

/// The bytes Gallatin hands out for a request: a power-of-two slice of 16 B to 4 KiB, or a
/// power-of-two block (4096 slices) above that.
pub(super) fn granted(bytes: u64) -> u64 {
    bytes.max(16).next_power_of_two()
}

/// The heap for requests that take `demand` bytes as Gallatin rounds them: twice that, plus
/// room for the size trees' segments, in whole segments; or `gib` GiB when given.
pub(super) fn heap_bytes(demand: u64, gib: Option<f64>) -> u64 {
    let bytes = match gib {
        Some(g) => (g * (1u64 << 30) as f64) as u64,
        None => demand.saturating_mul(2).saturating_add(SLACK),
    };
    bytes.div_ceil(SEGMENT).max(1) * SEGMENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_names_every_setting_of_the_row() {
        let one = Request {
            n: 1 << 22,
            sizes: Sizes::One(16),
            heap_bytes: 3 << 30,
            runs: 5,
        };
        assert_eq!(
            one.args().join(" "),
            "--n 4194304 --size 16 --heap-bytes 3221225472 --runs 5"
        );
        let mixed = Request {
            sizes: Sizes::Mixed { max: 4096, seed: 1 },
            ..one
        };
        assert_eq!(
            mixed.args().join(" "),
            "--n 4194304 --max 4096 --seed 1 --heap-bytes 3221225472 --runs 5"
        );
    }

    #[test]
    fn nvcc_builds_for_the_device_against_the_checkout() {
        let args = nvcc_args(
            Path::new("/g/include"),
            Path::new("/t/harness.cu"),
            Path::new("/t/harness"),
            (9, 0),
        );
        let args: Vec<_> = args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "-O3",
                "-std=c++17",
                "-arch=sm_90",
                "-I",
                "/g/include",
                "-o",
                "/t/harness",
                "/t/harness.cu"
            ]
        );
    }

    #[test]
    fn parses_the_harness_line_among_other_output() {
        let out = "Booted\ncarve-gallatin n=4194304 size=0 max=4096 seed=1 heap_bytes=1 runs=5 \
                   alloc_ms=2.000000 free_ms=0.080000 failed=3\n";
        let m = parse(out).unwrap();
        assert_eq!(
            m,
            Measured {
                alloc_ms: 2.0,
                free_ms: 0.08,
                failed: 3
            }
        );
    }

    #[test]
    fn a_bad_line_is_an_error_not_a_figure() {
        assert!(parse("").unwrap_err().contains("no carve-gallatin line"));
        let no_free = "carve-gallatin alloc_ms=1.0 failed=0";
        assert!(parse(no_free).unwrap_err().contains("no free_ms="));
        let zero = "carve-gallatin alloc_ms=0 free_ms=1.0 failed=0";
        assert!(parse(zero)
            .unwrap_err()
            .contains("alloc_ms is not a positive time"));
        let nan = "carve-gallatin alloc_ms=NaN free_ms=1.0 failed=0";
        assert!(parse(nan).is_err());
        let neg = "carve-gallatin alloc_ms=1.0 free_ms=1.0 failed=-1";
        assert!(parse(neg).is_err());
        // A key is matched whole: `xalloc_ms` is not `alloc_ms`.
        let prefixed = "carve-gallatin xalloc_ms=1.0 free_ms=1.0 failed=0";
        assert!(parse(prefixed).is_err());
    }

    #[test]
    fn nvcc_is_cudacxx_when_set_else_searched() {
        let dir = tempfile::tempdir().unwrap();
        let nvcc = dir.path().join("nvcc");
        std::fs::write(&nvcc, "").unwrap();
        let missing = dir.path().join("none").join("nvcc");
        assert_eq!(
            find_nvcc(Some(nvcc.clone().into()), None, None),
            Ok(nvcc.clone())
        );
        let err = find_nvcc(Some(missing.into()), Some(dir.path().into()), None).unwrap_err();
        assert!(err.contains("CUDACXX="), "{err}");
        let path = std::env::join_paths([Path::new("/nonexistent"), dir.path()]).unwrap();
        assert_eq!(find_nvcc(None, Some(path), None), Ok(nvcc.clone()));
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir(home.path().join("bin")).unwrap();
        std::fs::write(home.path().join("bin/nvcc"), "").unwrap();
        assert_eq!(
            find_nvcc(Some("".into()), None, Some(home.path().into())),
            Ok(home.path().join("bin/nvcc"))
        );
    }

    #[test]
    fn a_checkout_without_the_header_is_named_in_the_reason() {
        assert!(find(None).unwrap_err().contains("no --gallatin DIR"));
        let dir = tempfile::tempdir().unwrap();
        let err = find(Some(dir.path())).unwrap_err();
        assert!(err.contains(HEADER), "{err}");
    }

    /// With `CARVE_GALLATIN_DIR` (a checkout) and nvcc, the harness builds into a directory of
    /// its own that goes with it, and a machine without a GPU makes it fail with a reason.
    #[test]
    fn builds_the_harness_when_given_a_checkout_and_nvcc() {
        use std::io::Write;
        let Some(dir) = std::env::var_os("CARVE_GALLATIN_DIR") else {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED builds_the_harness_when_given_a_checkout_and_nvcc: \
                 CARVE_GALLATIN_DIR (a Gallatin checkout) is not set"
            );
            return;
        };
        let found = find(Some(Path::new(&dir))).unwrap();
        // The device's architecture where there is one, else the H100's.
        let cc = carve::Device::get(0)
            .and_then(|d| d.properties())
            .map_or((9, 0), |p| p.compute_capability);
        let h = found.build(cc).unwrap();
        assert!(h.exe.is_file(), "{}", h.built);
        eprintln!("harness {}", h.built);
        let tmp = h._dir.path().to_path_buf();
        let req = Request {
            n: 1024,
            sizes: Sizes::Mixed { max: 4096, seed: 1 },
            heap_bytes: 1 << 30,
            runs: 5,
        };
        match h.run(&req) {
            Ok(m) => assert!(m.alloc_ms > 0.0 && m.failed == 0, "{m:?}"),
            Err(e) => {
                eprintln!("{e}");
                assert!(e.contains("exited with"), "{e}");
            }
        }
        drop(h);
        assert!(!tmp.exists());
    }

    #[cfg(unix)]
    #[test]
    fn the_build_directory_is_the_users_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = private_dir().unwrap();
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("carve-gallatin-"));
    }

    #[test]
    fn heaps_are_whole_segments_with_room() {
        assert_eq!(granted(16), 16);
        assert_eq!(granted(17), 32);
        assert_eq!(granted(4096), 4096);
        assert_eq!(granted(1), 16);
        // 2^22 × 16 B: 64 MiB asked, 128 MiB + 1 GiB given.
        assert_eq!(heap_bytes(64 << 20, None), (128 << 20) + (1 << 30));
        assert_eq!(heap_bytes(1, None) % SEGMENT, 0);
        assert_eq!(heap_bytes(1 << 40, Some(7.0)), 7 << 30);
        assert_eq!(heap_bytes(0, Some(0.001)), SEGMENT);
    }
}
