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
fn embedded_ptx_holds_the_kernels() {
    let ptx = carve::driver::PTX;
    assert!(ptx.contains(".target sm_70"), "PTX target line missing");
    assert!(
        ptx.contains(".visible .entry carve_smoke_fill("),
        "smoke kernel missing"
    );
    assert!(carve::driver::kernel_names().any(|k| k == "carve_smoke_fill"));
}

fn carve_bin() -> Option<std::path::PathBuf> {
    carve::testing::cli_binary(env!("CARGO_BIN_EXE_carve"))
}

#[test]
fn binary_embeds_the_ptx() {
    let Some(bin) = carve_bin() else { return };
    let bytes = std::fs::read(bin).unwrap();
    let needle = b".visible .entry carve_smoke_fill";
    assert!(bytes.windows(needle.len()).any(|w| w == needle));
}

#[test]
fn info_exits_zero_and_describes_what_it_found() {
    let Some(bin) = carve_bin() else { return };
    let out = Command::new(bin).arg("info").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let kernels = text
        .lines()
        .find_map(|l| l.split_once("kernels: "))
        .map(|(_, k)| k);
    assert!(
        kernels.is_some_and(|k| k.split(", ").any(|n| n == "carve_smoke_fill")),
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
