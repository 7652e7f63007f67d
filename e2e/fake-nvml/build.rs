//! Gives the library the soname the driver's has, so a program linked against it (or a loader
//! cache built over it) records `libnvidia-ml.so.1`, as with the real one.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
