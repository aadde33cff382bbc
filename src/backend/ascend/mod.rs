//! Huawei's CANN libraries: the ACL runtime, the aclnn operators, HCCL.

pub mod acl;
pub mod aclnn;
pub mod hccl;
