pub mod child;
pub mod standin;
