//! Starting the ranks of an instance as local processes.
