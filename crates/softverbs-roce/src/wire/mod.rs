//! (wire formats: in progress)
