//! Loads an MNIST-layout directory, prints its shape, load time and MD5 report.
//!
//! `cargo run --release -p flotilla-data --example load_mnist -- [DIR]` (default `data/mnist`).

use std::time::Instant;

use flotilla_data::{DataError, Mnist, verify_md5};

fn main() -> Result<(), DataError> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "data/mnist".to_owned());
    let start = Instant::now();
    let splits = Mnist::load(&dir)?;
    let elapsed = start.elapsed();
    for (name, ds) in [("train", &splits.train), ("test", &splits.test)] {
        println!(
            "{name}: {} images of {}x{}, {} classes",
            ds.len(),
            ds.rows(),
            ds.cols(),
            ds.num_classes()
        );
    }
    println!("loaded in {:.3} s", elapsed.as_secs_f64());
    let start = Instant::now();
    let report = verify_md5(&dir)?;
    println!("{report}");
    println!(
        "MNIST: {} (checked in {:.3} s)",
        report.is_mnist(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
