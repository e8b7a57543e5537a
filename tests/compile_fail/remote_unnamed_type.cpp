// expect: a type in a DISTRPC_REMOTE declaration has no library name
#include "distrpc/distrpc.hpp"
struct Point {
  double x, y;
};
DISTRPC_REMOTE(move, "geo.move", Point(Point, double));
