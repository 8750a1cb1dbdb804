//! (simulator: in progress)
