//! Checks that every C function which reads or writes through a caller's pointer, or hands a
//! caller's stream to the driver, is `unsafe` to call from Rust: one `compile_fail` doctest
//! per function calls it from safe code, and one doctest shows the same calls compile inside
//! `unsafe` (so each `compile_fail` fails for the missing `unsafe` alone).

macro_rules! unsafe_to_call {
    ($($name:ident: $call:expr;)*) => {
        /// The calls compile inside `unsafe`.
        ///
        /// ```no_run
        /// # use carve_capi::{ffi::*, frameworks::*};
        /// # use std::ptr::{null, null_mut};
        /// # let (h, mut out, mut p, mut n): (carve_resource_t, carve_resource_t, *mut std::ffi::c_void, usize) =
        /// #     (null_mut(), null_mut(), null_mut(), 0);
        /// unsafe {
        $(#[doc = concat!("    let _ = ", stringify!($call), ";")])*
        /// }
        /// ```
        pub mod all_in_unsafe {}

        $(
            #[doc = concat!(
                "```compile_fail,E0133\n",
                "# use carve_capi::{ffi::*, frameworks::*};\n",
                "# use std::ptr::{null, null_mut};\n",
                "# let (h, mut out, mut p, mut n): (carve_resource_t, carve_resource_t, *mut std::ffi::c_void, usize) =\n",
                "#     (null_mut(), null_mut(), null_mut(), 0);\n",
                "let _ = ", stringify!($call), ";\n",
                "```"
            )]
            pub mod $name {}
        )*
    };
}

unsafe_to_call! {
    carve_cuda_resource_create: carve_cuda_resource_create(0, &mut out);
    carve_managed_resource_create: carve_managed_resource_create(0, &mut out);
    carve_pinned_resource_create: carve_pinned_resource_create(0, 0, &mut out);
    carve_async_resource_create: carve_async_resource_create(0, 0, SIZE_NONE, SIZE_NONE, &mut out);
    carve_host_resource_create: carve_host_resource_create(&mut out);
    carve_pool_resource_create: carve_pool_resource_create(h, 0, SIZE_NONE, &mut out);
    carve_binning_resource_create: carve_binning_resource_create(h, 8, 12, &mut out);
    carve_arena_resource_create: carve_arena_resource_create(h, 0, 1, SIZE_NONE, &mut out);
    carve_fixed_size_resource_create: carve_fixed_size_resource_create(h, 256, 0, &mut out);
    carve_limiting_adaptor_create: carve_limiting_adaptor_create(h, 1, &mut out);
    carve_statistics_adaptor_create: carve_statistics_adaptor_create(h, &mut out);
    carve_tracking_adaptor_create: carve_tracking_adaptor_create(h, 0, &mut out);
    carve_logging_adaptor_create: carve_logging_adaptor_create(h, null(), 0, &mut out);
    carve_allocate: carve_allocate(h, 64, 256, null_mut(), &mut p);
    carve_deallocate: carve_deallocate(h, p, 64, 256, null_mut());
    carve_resource_stats: carve_resource_stats(h, null_mut(), 0, &mut n);
    carve_resource_release: carve_resource_release(h, &mut n);
    carve_set_current_resource: carve_set_current_resource(0, h, &mut out);
    carve_get_current_resource: carve_get_current_resource(0, &mut out);
    carve_torch_alloc: carve_torch_alloc(64, 0, null_mut());
    carve_torch_free: carve_torch_free(p, 64, 0, null_mut());
    carve_torch_alloc_0: carve_torch_alloc_0(64, 0, null_mut());
    carve_torch_free_0: carve_torch_free_0(p, 64, 0, null_mut());
    carve_torch_alloc_15: carve_torch_alloc_15(64, 0, null_mut());
    carve_torch_free_15: carve_torch_free_15(p, 64, 0, null_mut());
    carve_cupy_free: carve_cupy_free(0, 0, 0);
    carve_ort_free: carve_ort_free(p);
}
