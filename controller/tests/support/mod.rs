pub mod standin;
