pub mod bed;
pub mod child;
pub mod standin;
