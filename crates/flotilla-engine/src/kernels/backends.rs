//! The backends of the engine's backend extensions, listed once for all of them (the kernels
//! here and [`crate::collective`]): [`engine_extension!`] puts a trait behind burn's
//! `#[backend_extension]` over them, and [`impl_on_burn_backends!`] writes the trait's impls
//! on the backends that run burn's own ops (the trait's default bodies), each behind the cargo
//! feature that brings its backend. Flex (the host kernels) and `Autodiff` (the hand-written
//! backward) are implemented in each extension's own file.

/// `$item`, a trait, as a burn backend extension
/// ([`#[backend_extension]`](burn::backend::backend_extension)) over the engine's backends:
/// Flex; NdArray, LibTorch and burn's cubecl `Cube` behind the features `ndarray`, `libtorch`
/// and `wgpu`; and `Autodiff`, routed to the extension's `impl … for Autodiff<B, C>`. A file
/// that uses it allows `deprecated` under the `ndarray` and `libtorch` features (the routing
/// names NdArray and LibTorch).
// rustfmt would indent the attribute's list further at every run (its macro-body formatting).
#[rustfmt::skip]
macro_rules! engine_extension {
    ($item:item) => {
        #[burn::backend::backend_extension(
            Flex,
            NdArray: cfg(feature = "ndarray"),
            LibTorch: cfg(feature = "libtorch"),
            Cube: cfg(feature = "wgpu"),
            Autodiff,
        )]
        $item
    };
}

/// The empty impls of `$trait` on the backends of [`engine_extension!`] that run burn's own
/// ops (its default bodies), each behind its feature: NdArray, LibTorch and `Cube`.
macro_rules! impl_on_burn_backends {
    ($trait:ident) => {
        #[cfg(feature = "ndarray")]
        impl $trait for burn::backend::NdArray {}

        // burn 0.22 deprecates its LibTorch backend but still ships it (the `libtorch` feature).
        #[cfg(feature = "libtorch")]
        #[allow(deprecated)]
        impl $trait for burn::backend::LibTorch {}

        // burn's cubecl backend (the `wgpu` feature).
        #[cfg(feature = "wgpu")]
        impl $trait for burn::backend::Cube {}
    };
}

pub(crate) use {engine_extension, impl_on_burn_backends};
