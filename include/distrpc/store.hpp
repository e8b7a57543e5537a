// The store layer in one include: the Store interface, its four implementations, the store-based
// barrier and rendezvous(url).
#pragma once

#include "distrpc/store/barrier.hpp"
#include "distrpc/store/file_store.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/store/prefix_store.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/store/tcp_store.hpp"
