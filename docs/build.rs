//! Turns every ```rust block of `guide/*.md` into a `#[test]` in `$OUT_DIR/guide_examples.rs`,
//! which `tests/guide.rs` includes.
//!
//! Lines starting with `# ` are code that rustdoc hides, as in doctests. A block becomes the body
//! of a function returning `Result<(), Box<dyn Error>>`, followed by `Ok(())` (so `?` works and
//! a block ends as a reader would write it), or, when it defines `fn main`, that `main` is
//! called. Blocks marked `ignore` are shown only; `no_run` ones are compiled, not run.
//! Tests are named after the chapter file and the block's index among its ```rust blocks:
//! `ch02_memory_resources_3` is the third one of `02-memory-resources.md`.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("guide");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut chapters: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    let mut out = String::new();
    for path in &chapters {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a UTF-8 name");
        let prefix = format!("ch{}", stem.replace('-', "_"));
        for (index, block) in rust_blocks(&text).into_iter().enumerate() {
            let name = format!("{prefix}_{}", index + 1);
            let source = format!("docs/guide/{stem}.md:{}", block.line);
            match block.mode {
                Mode::Ignore => {}
                Mode::Run => write_example(&mut out, &name, &source, &block.code, true),
                Mode::NoRun => write_example(&mut out, &name, &source, &block.code, false),
            }
        }
    }
    let dest = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("guide_examples.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Run,
    NoRun,
    Ignore,
}

struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    mode: Mode,
    code: String,
}

/// The ```rust blocks of a Markdown text, with rustdoc's hidden-line markers removed.
fn rust_blocks(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<(Option<Block>, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let fence = "`".repeat(3 + info.chars().take_while(|&c| c == '`').count());
                    open = Some((
                        rust_mode(info).map(|mode| Block {
                            line: i + 1,
                            mode,
                            code: String::new(),
                        }),
                        fence,
                    ));
                }
            }
            Some((block, fence)) => {
                if trimmed.starts_with(&fence) && trimmed.trim_end() == fence {
                    blocks.extend(block);
                } else {
                    let block = block.map(|mut b| {
                        b.code.push_str(unhide(line));
                        b.code.push('\n');
                        b
                    });
                    open = Some((block, fence));
                }
            }
        }
    }
    assert!(open.is_none(), "a code block is not closed");
    blocks
}

/// How a block with this info string runs, or `None` when it is no Rust block.
fn rust_mode(info: &str) -> Option<Mode> {
    let words: Vec<&str> = info
        .trim_start_matches('`')
        .split([',', ' '])
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .collect();
    // rustdoc takes a block without a language for Rust, and so does this.
    if words.first().is_some_and(|&w| w != "rust") {
        return None;
    }
    Some(if words.contains(&"ignore") {
        Mode::Ignore
    } else if words.contains(&"no_run") {
        Mode::NoRun
    } else {
        Mode::Run
    })
}

/// A line as the compiler sees it: rustdoc's `# ` prefix (hidden code) removed, `##` unescaped.
fn unhide(line: &str) -> &str {
    let trimmed = line.trim_start();
    if trimmed == "#" {
        ""
    } else if let Some(rest) = trimmed.strip_prefix("# ") {
        rest
    } else if trimmed.starts_with("##") {
        &trimmed[1..]
    } else {
        line
    }
}

fn write_example(out: &mut String, name: &str, source: &str, code: &str, run: bool) {
    let has_main = code.contains("fn main(");
    let attr = if run {
        "#[test]"
    } else {
        "#[allow(dead_code)]"
    };
    let indented: String = code.lines().fold(String::new(), |mut s, l| {
        let _ = writeln!(s, "        {l}");
        s
    });
    let _ = writeln!(
        out,
        "/// {source}\n{attr}\nfn {name}() -> carve_guide::ExampleResult {{"
    );
    let _ = writeln!(out, "    carve_guide::enter({name:?});");
    if has_main {
        let _ = write!(
            out,
            "    {{\n{indented}        carve_guide::finish(main())\n    }}\n"
        );
    } else {
        let _ = write!(
            out,
            "    fn example() -> carve_guide::ExampleResult {{\n{indented}        Ok(())\n    }}\n    \
             example()\n"
        );
    }
    let _ = writeln!(out, "}}\n");
}
