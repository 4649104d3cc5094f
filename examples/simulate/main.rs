//! Cluster simulation (the main job), in progress.
fn main() {}
