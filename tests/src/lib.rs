//! What the cross-component tests in `tests/tests/` share: the controller +
//! agent fixture on the test bed ([`bed`]) and the controller as a child
//! process ([`controller_process`]).

pub mod bed;
pub mod controller_process;
