//! What must hold on every machine, GPU or not: no panics without a driver, typed errors, the
//! embedded PTX, and the CLI.

use std::process::Command;

use carve::{Device, Error};

#[test]
fn device_queries_never_panic() {
    match Device::count() {
        Err(Error::NoDriver(msg)) => {
            assert!(!msg.is_empty());
            assert!(matches!(Device::get(0), Err(Error::NoDriver(_))));
            assert!(matches!(
                carve::CudaMemoryResource::on(0),
                Err(Error::NoDriver(_))
            ));
            assert!(matches!(carve::current::get(0), Err(Error::NoDriver(_))));
        }
        Ok(n) => assert!(matches!(
            Device::get(n),
            Err(Error::InvalidDevice { .. } | Error::NoDevice)
        )),
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn shipped_ptx_exports_exactly_the_documented_abi() {
    let ptx = carve::driver::PTX;
    assert!(ptx.contains(".target sm_70"), "PTX target line missing");
    let mut exported: Vec<_> = carve::driver::exported_symbols(ptx).collect();
    exported.sort_unstable();
    let mut expected = carve::driver::SHIPPED_SYMBOLS.to_vec();
    expected.sort_unstable();
    assert_eq!(exported, expected);
    // No kernel is shipped: carve's own host code launches none.
    assert_eq!(carve::driver::kernel_names(ptx).count(), 0);
    // CUDA's heap would show as the identifier `malloc` (carve's own `carve_malloc` does not).
    let needs_cuda_heap = ptx
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
        .any(|ident| ident == "malloc" || ident == "free");
    assert!(
        !needs_cuda_heap,
        "the shipped module must not need CUDA's heap"
    );
}

#[test]
fn the_header_declares_every_shipped_function() {
    let header = include_str!("../../kernels/carve_heap.h");
    for name in carve::driver::SHIPPED_SYMBOLS {
        assert!(
            header.contains(&format!("{name}(")),
            "{name} is exported but not declared in kernels/carve_heap.h"
        );
    }
}

#[test]
fn test_kernels_live_in_their_own_module() {
    let test = carve_lab::TEST_PTX;
    let kernels: Vec<_> = carve::driver::kernel_names(test).collect();
    for k in [
        "carve_smoke_fill",
        "carve_heap_slab_alloc",
        "carve_bench_malloc",
    ] {
        assert!(kernels.contains(&k), "{k} missing from the test module");
        assert!(
            !carve::driver::PTX.contains(k),
            "{k} leaked into the shipped module"
        );
    }
}

#[test]
fn exported_symbols_parses_every_kind_of_declaration() {
    let ptx = ".visible .entry k1(\n.visible .func  (.param .b64 func_retval0) f2(\n\
               .visible .func f3()\n.visible .global .align 4 .u32 g4;\n.func hidden(";
    let names: Vec<_> = carve::driver::exported_symbols(ptx).collect();
    assert_eq!(names, ["k1", "f2", "f3", "g4"]);
}

#[test]
fn committed_ptx_matches_what_this_build_embeds_when_built_from_it() {
    // With CARVE_BUILD_KERNELS=0 the embedded text is the committed file itself.
    if std::env::var_os("CARVE_BUILD_KERNELS").is_some_and(|v| v == "0") {
        assert_eq!(
            carve::driver::PTX,
            include_str!("../../src/driver/ptx/carve.ptx")
        );
        assert_eq!(carve_lab::TEST_PTX, include_str!("../ptx/carve_test.ptx"));
    }
    for ptx in [carve::driver::PTX, carve_lab::TEST_PTX] {
        assert!(ptx.starts_with("// carve PTX module"), "header missing");
        assert!(ptx.lines().any(|l| l.starts_with("// sources: sha256 ")));
    }
}

fn carve_bin() -> Option<std::path::PathBuf> {
    carve::testing::cli_binary(env!("CARGO_BIN_EXE_carve"))
}

#[test]
fn binary_embeds_the_ptx() {
    let Some(bin) = carve_bin() else { return };
    let bytes = std::fs::read(bin).unwrap();
    let needle = b".visible .func  (.param .b64 func_retval0) carve_slab_alloc";
    assert!(bytes.windows(needle.len()).any(|w| w == needle));
}

#[test]
fn info_exits_zero_and_describes_what_it_found() {
    let Some(bin) = carve_bin() else { return };
    let out = Command::new(bin).arg("info").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let exports = text
        .lines()
        .find_map(|l| l.split_once("exports: "))
        .map(|(_, k)| k);
    assert!(
        exports.is_some_and(|k| k.split(", ").any(|n| n == "carve_slab_alloc")),
        "{text}"
    );
    match Device::count() {
        Err(_) => assert!(text.contains("No CUDA driver found"), "{text}"),
        Ok(n) => assert!(text.contains(&format!("{n} CUDA device(s)")), "{text}"),
    }
}

#[test]
fn bench_runs_quickly_and_prints_a_table() {
    let Some(bin) = carve_bin() else { return };
    let out = Command::new(bin)
        .args(["bench", "alloc-free", "--quick"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("| resource | bytes | allocate | deallocate |"),
        "{text}"
    );
    assert!(text.contains("| host (std::alloc) | 65536 |"), "{text}");
}

/// `carve bench device-alloc --only slab` at 2^20 × 16 B with `--gallatin` and `env`: it
/// exits 0 and prints its tables, on a GPU machine or not.
fn device_alloc_with_gallatin(dir: &std::path::Path, env: &[(&str, &str)]) -> Option<String> {
    let bin = carve_bin()?;
    let out = Command::new(bin)
        .args([
            "bench",
            "device-alloc",
            "--only",
            "slab",
            "--log-threads",
            "20",
        ])
        .args(["--block", "16", "--gallatin"])
        .arg(dir)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn device_alloc_says_why_gallatin_is_left_out_and_still_runs() {
    // No checkout at DIR.
    let none = tempfile::tempdir().unwrap();
    let Some(text) = device_alloc_with_gallatin(&none.path().join("gallatin"), &[]) else {
        return;
    };
    assert!(
        text.contains("Gallatin columns left out: --gallatin"),
        "{text}"
    );
    assert!(
        text.contains("include/gallatin/allocators/gallatin.cuh"),
        "{text}"
    );
    assert!(!text.contains("| Gallatin alloc |"), "{text}");
    // A checkout, but no nvcc.
    let checkout = tempfile::tempdir().unwrap();
    let header = checkout.path().join("include/gallatin/allocators");
    std::fs::create_dir_all(&header).unwrap();
    std::fs::write(header.join("gallatin.cuh"), "").unwrap();
    let missing = none.path().join("bin/nvcc");
    let text =
        device_alloc_with_gallatin(checkout.path(), &[("CUDACXX", missing.to_str().unwrap())])
            .unwrap();
    assert!(
        text.contains("Gallatin columns left out: nvcc not found: CUDACXX="),
        "{text}"
    );
    assert!(!text.contains("| Gallatin alloc |"), "{text}");
    // Either way the table is there, measured or saying why not.
    assert!(text.contains("| N | block B | empty kernel ms |"), "{text}");
    if Device::count().is_err() {
        assert!(text.contains("nothing measured"), "{text}");
    }
}
